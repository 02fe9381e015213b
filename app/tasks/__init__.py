"""The built-in tasks (`task.name = "mnist"`); app/task.py is the interface they implement."""
