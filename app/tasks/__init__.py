"""The built-in tasks (`task.name = "mnist"`, `"recommender"`); app/task.py is the interface
they implement."""
