import importlib.util
import json
import pathlib
import sys

import pytest

from tools import bench, bench_report


def sets(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def test_runs_are_pure_training_of_the_asked_steps():
    args = bench.train_args("configs/mnist.toml", ["train.global_batch_size=64"], steps=10)
    assert "task.train_examples=640" in sets(args) and "task.validation_examples=0" in sets(args)
    assert "eval.test_every_epoch=false" in sets(args) and "train.epochs=1" in sets(args)


def test_epochs_train_over_the_same_examples_again(tmp_path, capsys):
    args = bench.train_args("configs/mnist.toml", ["train.global_batch_size=64"], steps=10,
                            epochs=5)
    assert "task.train_examples=640" in sets(args) and "train.epochs=5" in sets(args)
    assert bench.main(["--rows", "baseline", "--epochs", "0", "--workdir", str(tmp_path)]) == 2
    assert "--epochs must be at least 1, not 0" in capsys.readouterr().err


def test_a_run_may_be_evaluated_on_the_whole_test_set():
    args = bench.train_args("configs/mnist.toml", [], steps=10, whole_test_set=True)
    assert not [a for a in args if a.startswith("task.test_examples=")]
    assert "task.test_examples=32" in bench.train_args("configs/mnist.toml", [], steps=10)


def test_tasks_that_generate_their_data_get_no_mnist_source():
    args = bench.train_args("configs/recommender.toml", [], steps=10)
    assert "task.train_examples=5120" in sets(args)
    assert not any(s.startswith("task.source") for s in sets(args))
    assert "task.source=synthetic" in sets(bench.train_args("configs/mnist.toml", [], 10))


def test_peak_memory_is_kept_per_task_type():
    runs = [{"train_examples_per_sec": 1, "peak_memory_mib": 1, "num_replicas": 1,
             "peak_rss_mib_by_task": {"worker": w, "ps": 300}} for w in (700, 900)]
    summary = bench.summarize({"rec_ps_2w2p": runs})["rec_ps_2w2p"]
    assert summary["peak_rss_mib_by_task"] == {"worker": 900, "ps": 300}  # the largest run


def test_rows_start_plain_and_the_users_settings_come_after():
    args = bench.train_args("configs/mnist.toml", ["train.jit_compile=true"], steps=10)
    assert sets(args).index("train.jit_compile=false") < sets(args).index("train.jit_compile=true")


def test_a_rows_own_settings_come_last():
    args = bench.row_args("xla", bench.train_args("configs/mnist.toml", [], 10), gpus=0)
    assert args[:2] == ["-m", "app.train"] and sets(args)[-1] == "train.jit_compile=true"


@pytest.mark.parametrize("gpus, expected", [
    (0, ["runtime.cpu_devices=2"]), (1, ["runtime.gpu_devices=2"]), (4, [])])
def test_two_device_mirrored_row_uses_what_the_machine_has(gpus, expected):
    args = bench.row_args("mirrored_2dev", [], gpus)
    assert sets(args) == expected


def test_unknown_row_is_an_error(capsys):
    assert bench.main(["--rows", "tpu pod"]) == 2
    assert "error: --rows: unknown row(s) ['tpu pod']" in capsys.readouterr().err


def test_summary_takes_medians_and_ratios_to_the_first_row():
    def run(speed, memory, **extra):
        return {"train_examples_per_sec": speed, "peak_memory_mib": memory,
                "num_replicas": 1, **extra}
    ps = {"ps_bytes": [100, 120], "ps_balance": 1.09}
    results = bench.summarize({
        "baseline": [run(400, 900, cpu_seconds={"main": 50}),
                     run(500, 950, cpu_seconds={"main": 40}),
                     run(420, 940, cpu_seconds={"main": 45})],
        "ps_2w2p": [run(210, 3000, **ps), run(200, 3100, **ps), run(100, 2900, **ps)],
    })
    assert results["baseline"]["examples_per_sec"] == 420 and results["baseline"]["ratio"] == 1.0
    assert results["ps_2w2p"]["examples_per_sec"] == 200 and results["ps_2w2p"]["ratio"] == 0.476
    assert results["ps_2w2p"]["peak_memory_mib"] == 3100
    assert results["ps_2w2p"]["ps_bytes"] == [100, 120] and "ps_bytes" not in results["baseline"]
    text = bench_report.table(results)
    assert "ps_2w2p" in text and "100" not in text.split("\n")[2]
    assert results["baseline"]["steps_per_sec"] == 0  # not in these runs: shown as 0
    assert results["baseline"]["cpu_seconds"] == {"main": 45}
    assert "main 45" in bench_report.table(results) and results["ps_2w2p"]["cpu_seconds"] == {}


def test_a_row_whose_base_has_no_run_has_no_ratio():
    # As when every run of the base failed (a setting one process refuses).
    run = {"train_examples_per_sec": 300, "peak_memory_mib": 900, "num_replicas": 1}
    results = bench.summarize({"ps_2w2p": [run], "ps_2w2p_spe8": [{**run,
                                                                   "train_examples_per_sec": 150}]})
    assert results["ps_2w2p"]["ratio"] is None and results["ps_2w2p"]["ratio_to"] is None
    assert results["ps_2w2p_spe8"]["ratio"] is None
    assert "300      -" in bench_report.table(results).split("\n")[2]


def test_in_a_sweep_a_multi_task_row_is_to_its_base_at_the_same_link():
    run = {"peak_memory_mib": 900, "num_replicas": 1}
    results = bench.summarize({
        "mwms_2w@100mbit": [{**run, "train_examples_per_sec": 100}],
        "mwms_2w@1gbit": [{**run, "train_examples_per_sec": 400}],
        "keras3_mwms_2w@1gbit": [{**run, "train_examples_per_sec": 200}]})
    assert results["keras3_mwms_2w@1gbit"]["ratio_to"] == "mwms_2w@1gbit"
    assert results["keras3_mwms_2w@1gbit"]["ratio"] == 0.5


def test_a_linked_runs_bytes_are_read_from_its_log_and_given_per_step():
    log = ("[worker:0] INFO step 50\n[launch] bytes through each task's link: chief:0 in 1.2 MiB "
           "out 3.5 MiB, worker:0 in 850.3 MiB out 12.0 MiB, ps:0 in 10.0 MiB out 400.1 MiB\n")
    carried = bench.link_bytes(log)
    assert carried == {"chief:0": [1.2, 3.5], "worker:0": [850.3, 12.0], "ps:0": [10.0, 400.1]}
    assert bench.link_bytes("[worker:0] INFO step 50\n") == {}
    run = {"train_examples_per_sec": 100, "peak_memory_mib": 1, "num_replicas": 1, "steps": 100,
           "link_mib": carried}
    results = bench.summarize({"ps_2w2p": [run, {**run, "steps": 200}, run]})
    assert results["ps_2w2p"]["link_mib_per_step"]["worker:0"] == [8.503, 0.12]
    assert results["ps_2w2p"]["link_mib"]["worker:0"] == [850.3, 12.0]  # the whole run's


def test_a_steps_cost_is_the_difference_of_two_runs_over_their_steps():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
    import per_step

    short = {"cpu_seconds": {"worker": 10.0, "ps": 2.0},
             "link_mib": {"worker:0": [100.0, 50.0], "ps:0": [25.0, 75.0]}}
    long = {"cpu_seconds": {"worker": 30.0, "ps": 6.0},
            "link_mib": {"worker:0": [300.0, 150.0], "ps:0": [75.0, 225.0]}}
    cost = per_step.per_step(short, long, 200)
    assert cost["cpu_ms_per_step"] == {"worker": 100.0, "ps": 20.0}
    assert cost["cpu_ms_per_step_in_all"] == 120.0
    assert cost["link_kib_per_step"] == {"worker:0": [1024.0, 512.0], "ps:0": [256.0, 768.0]}
    assert cost["link_kib_per_step_out_of_every_task"] == 1280.0
    assert "link_kib_per_step" not in per_step.per_step(
        {"cpu_seconds": {"main": 1.0}}, {"cpu_seconds": {"main": 2.0}}, 10)


def test_defaults_rows_run_at_the_project_defaults_and_compare_with_each_other():
    from app import config as cfg

    base = bench.train_args("configs/mnist.toml", [], 10)  # the plain settings first
    for row in ("defaults", "mwms_2w_defaults", "ps_2w2p_defaults"):
        args = bench.row_args(row, base, gpus=0)
        config = cfg.load("configs/mnist.toml", sets(args))  # the last --set wins, as in app.train
        assert config.runtime == cfg.load("configs/mnist.toml").runtime
        assert config.train.precision == cfg.Config().train.precision
        assert bench.ROWS[row].base == "defaults"
    assert "runtime.onednn=true" in bench.DEFAULTS  # what a user gets, unlike PLAIN
    for row in ("defaults_spe8", "ps_2w2p_spe8_defaults", "mwms_2w_spe8_defaults"):
        args = bench.row_args(row, base, gpus=0)
        config = cfg.load("configs/mnist.toml", sets(args))
        # The row's own setting of one of PLAIN's keys comes after the defaults, and wins.
        assert config.train.steps_per_execution == 8, row
        assert config.runtime == cfg.load("configs/mnist.toml").runtime
    results = bench.summarize({
        "baseline": [{"train_examples_per_sec": 400, "peak_memory_mib": 1, "num_replicas": 1}],
        "defaults": [{"train_examples_per_sec": 800, "peak_memory_mib": 1, "num_replicas": 1}],
        "mwms_2w_defaults": [{"train_examples_per_sec": 720, "peak_memory_mib": 1,
                              "num_replicas": 2}]})
    assert results["mwms_2w_defaults"]["ratio"] == 0.9
    assert results["mwms_2w_defaults"]["ratio_to"] == "defaults"
    assert results["defaults"]["ratio"] == 1.0 and results["baseline"]["ratio"] == 1.0


def test_every_row_runs_with_the_settings_its_name_says():
    from app import config as cfg

    base = bench.train_args("configs/mnist.toml", [], 10)
    named = {"nospin": ("runtime", "thread_spinning", False),
             "fp16": ("ps", "compression", "fp16"), "spe8": ("train", "steps_per_execution", 8),
             "threads2": ("runtime", "intra_op_threads", 2),
             "both": ("ps", "read_compression", "fp16")}
    checked = 0
    for row in bench.ROWS:
        args = bench.row_args(row, base, gpus=0)
        config = cfg.load("configs/mnist.toml", sets(args))
        for word, (section, key, value) in named.items():
            if word in row.split("_") and (word != "fp16" or row.startswith(("ps_", "sync_"))):
                assert getattr(getattr(config, section), key) == value, (row, key)
                checked += 1
    assert checked > 10


def test_seeds_train_each_repeat_at_its_own_seed_and_keep_every_metric(tmp_path, monkeypatch):
    seen = []

    def measure(args, workdir):
        seed = int(next(s for s in reversed(sets(args)) if s.startswith("train.seed="))[11:])
        seen.append(seed)
        return {"train_examples_per_sec": 500.0, "peak_memory_mib": 900.0, "num_replicas": 1,
                "metric": "test_accuracy", "test_accuracy": 0.9 + seed / 100}

    monkeypatch.setattr(bench, "measure", measure)
    assert bench.main(["--rows", "baseline", "--repeats", "3", "--seeds",
                       "--workdir", str(tmp_path)]) == 0
    assert seen == [0, 1, 2]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["seeds"] == [0, 1, 2]
    row = report["rows"]["baseline"]
    assert row["test_metric_samples"] == [0.9, 0.91, 0.92]
    assert row["test_metric_mean"] == 0.91


def test_a_failed_run_keeps_the_rows_that_ran(tmp_path, monkeypatch, capsys):
    def measure(args, workdir):
        if "mirrored" in args:
            raise bench.RunFailed("benchmark run failed: mirrored_1dev\nTraceback ...",
                                  "runtime.cpu_devices (3) is wrong; set it to 2")
        return {"train_examples_per_sec": 500.0, "peak_memory_mib": 900.0, "num_replicas": 1}

    monkeypatch.setattr(bench, "measure", measure)
    code = bench.main(["--rows", "mirrored_1dev", "--repeats", "2", "--workdir", str(tmp_path)])
    assert code == 1
    report = json.loads((tmp_path / "bench.json").read_text())
    assert list(report["rows"]) == [bench.BASELINE]
    assert report["rows"][bench.BASELINE]["samples"] == [500.0, 500.0]
    assert report["failed"]["mirrored_1dev"].startswith("benchmark run failed: mirrored_1dev")
    err = capsys.readouterr().err
    assert "error: benchmark run failed: mirrored_1dev" in err
    assert "repeat 1/2 mirrored_1dev: failed: runtime.cpu_devices (3) is wrong; set it to 2" in err


def test_a_failed_run_gives_the_first_reason_it_wrote(tmp_path):
    script = ("import sys; print('[ps:0] INFO serving'); "
              "print('[chief:0] error: task.x (3) is too large; lower it'); "
              "print('[ps:0] error: the chief failed'); sys.exit(2)")
    with pytest.raises(bench.RunFailed) as failed:
        bench.measure(["-c", script], tmp_path / "run")
    assert failed.value.reason == "task.x (3) is too large; lower it"
    assert str(failed.value).startswith("benchmark run failed: -c ")
    with pytest.raises(bench.RunFailed) as failed:
        bench.measure(["-c", "raise SystemExit(1)"], tmp_path / "other")
    assert failed.value.reason == ""


def test_only_the_rows_ratios_are_to_run_beside_the_rows_asked(tmp_path, monkeypatch):
    ran = []

    def measure(args, workdir):
        ran.append(args)
        return {"train_examples_per_sec": 500.0, "peak_memory_mib": 900.0, "num_replicas": 1}

    monkeypatch.setattr(bench, "measure", measure)
    assert bench.main(["--rows", "ps_2w2p_defaults", "--repeats", "1",
                       "--workdir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert list(report["rows"]) == ["defaults", "ps_2w2p_defaults"] and len(ran) == 2
    assert report["rows"]["ps_2w2p_defaults"]["ratio_to"] == "defaults"


def test_chart_draws_ratios_and_ps_bytes(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra: `make bench` installs it")
    results = {"baseline": {"ratio": 1.0}, "ps_2w2p": {"ratio": 0.5, "ps_bytes": [10, 12]}}
    assert bench_report.chart(results, "title", tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_smoke_writes_a_report_with_ratios(tmp_path):
    code = bench.main(["--steps", "30", "--repeats", "1", "--rows", "mirrored_1dev",
                       "--set", "train.global_batch_size=32", "--workdir", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["machine"]["cores"] > 0 and report["steps"] == 30
    rows = report["rows"]
    assert list(rows) == [bench.BASELINE, "mirrored_1dev"]  # baseline added first
    assert rows[bench.BASELINE]["ratio"] == 1.0
    for r in rows.values():
        assert r["examples_per_sec"] > 0 and len(r["samples"]) == 1
        assert r["peak_memory_mib"] > 100  # a TensorFlow process is never smaller


def test_links_shape_only_the_multi_task_rows():
    base = bench.train_args("configs/mnist.toml", [], 10)
    ps = bench.row_args("ps_2w2p", base, gpus=0, link="1gbit")
    assert ps[:2] == ["-m", "launch.local"] and ps[-2:] == ["--link", "1gbit"]
    assert "--link" not in bench.row_args("baseline", base, gpus=0, link="1gbit")
    assert "--link" not in bench.row_args("ps_2w2p", base, gpus=0)


def test_a_sweep_runs_each_multi_task_row_once_per_link():
    rows = ["baseline", "ps_2w2p", "mwms_2w"]
    assert bench.entries(rows, [None]) == [("baseline", "baseline", None),
                                           ("ps_2w2p", "ps_2w2p", None),
                                           ("mwms_2w", "mwms_2w", None)]
    assert bench.entries(rows, ["1gbit"])[1] == ("ps_2w2p", "ps_2w2p", "1gbit")
    assert bench.entries(rows, ["100mbit", "1gbit"]) == [
        ("baseline", "baseline", None),
        ("ps_2w2p@100mbit", "ps_2w2p", "100mbit"), ("ps_2w2p@1gbit", "ps_2w2p", "1gbit"),
        ("mwms_2w@100mbit", "mwms_2w", "100mbit"), ("mwms_2w@1gbit", "mwms_2w", "1gbit")]


def test_a_link_that_cannot_be_read_is_an_error_before_any_run(capsys):
    assert bench.main(["--links", "1gbit,fast", "--rows", "ps_2w2p"]) == 2
    assert "error: --link 'fast': cannot read 'fast'" in capsys.readouterr().err


def test_ps_rows_get_app_plans_bound_for_their_own_settings():
    rr, _ = bench.plan_bound("ps_2w2p_rr", "1gbit", "configs/mnist.toml", [])
    balanced, balanced_by = bench.plan_bound("ps_2w2p", "1gbit", "configs/mnist.toml", [])
    fp16, fp16_by = bench.plan_bound("ps_2w2p_fp16", "1gbit", "configs/mnist.toml", [])
    # Round-robin leaves the whole 12.25 MiB dense kernel on one ps task, which
    # sends it for every step (and a worker's read of it then push of all
    # gradients, 2 in parallel, takes as long); min_size splits it, and a worker's
    # read of half of it then push of all of it binds: (6.3 + 12.5) / 2 MiB.
    assert rr == pytest.approx(12.5 * 2**20 * 8 / 1e9, rel=0.01)
    assert rr / balanced == pytest.approx(12.5 / ((6.3 + 12.5) / 2), rel=0.02)
    assert balanced_by.startswith("each worker's read")
    # Float16 pushes halve the push; the float32 reads out of a ps task then bind.
    assert balanced / fp16 == pytest.approx((6.3 + 12.5) / 2 / 6.3, rel=0.02)
    assert fp16_by.endswith(" sends")
    assert bench.plan_bound("baseline", "1gbit", "configs/mnist.toml", []) is None


def test_multi_worker_mirrored_rows_get_the_all_reduces_bound():
    # Two workers: each sends all 12.5 MiB of float32 gradients a step, half as float16.
    full, by = bench.plan_bound("mwms_2w", "100mbit", "configs/mnist.toml", [])
    assert full == pytest.approx(3_274_634 * 4 * 8 / 1e8) and by == "each worker's all-reduce"
    half, _ = bench.plan_bound("mwms_2w_fp16", "100mbit", "configs/mnist.toml", [])
    assert half == pytest.approx(full / 2)


def test_measured_step_times_are_set_beside_the_bound():
    results = {"ps_2w2p": {"steps_per_sec": 2.0}, "baseline": {"steps_per_sec": 5.0}}
    bench.add_bounds(results, {"ps_2w2p": (0.4, "ps:1 sends")})
    assert results["ps_2w2p"]["step_ms"] == 500 and results["ps_2w2p"]["step_over_bound"] == 1.25
    assert "plan_bound_ms" not in results["baseline"]
    assert bench_report.bound_lines(results) == [
        "ps_2w2p: step 500.0 ms, tools.plan's bound 400.0 ms (ps:1 sends): 1.250x"]


def test_sweep_chart_draws_throughput_against_bandwidth(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra: `make bench` installs it")
    results = {"baseline": {"examples_per_sec": 700},
               "ps_2w2p@100mbit": {"examples_per_sec": 200, "link": "100mbit"},
               "ps_2w2p@1gbit": {"examples_per_sec": 600, "link": "1gbit"}}
    assert bench_report.sweep_chart(results, "title", tmp_path / "bench.png", "baseline")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweeps_rows_keep_their_link_and_their_rows_description():
    run = {"train_examples_per_sec": 300, "peak_memory_mib": 900, "num_replicas": 1,
           "link": "1gbit"}
    results = bench.summarize({"baseline": [{**run, "link": None}], "ps_2w2p@1gbit": [run]})
    assert results["ps_2w2p@1gbit"]["link"] == "1gbit"
    assert results["ps_2w2p@1gbit"]["what"] == bench.ROWS["ps_2w2p"].what


def test_a_saved_report_is_printed_and_drawn_again(tmp_path, capsys):
    row = {"examples_per_sec": 200.0, "ratio": 0.5, "steps_per_sec": 2.0, "test_metric": 0.9,
           "peak_memory_mib": 900, "link": "100mbit", "plan_bound_ms": 400.0,
           "plan_bound_link": "what ps:0 sends", "step_ms": 500.0, "step_over_bound": 1.25}
    report = {"command": "python -m tools.bench --links 100mbit,1gbit",
              "machine": {"cpu": "cpu", "cores": 2, "gpu": "none"},
              "links": ["100mbit", "1gbit"],
              "rows": {"baseline": {**row, "examples_per_sec": 400.0, "ratio": 1.0},
                       "ps_2w2p@100mbit": row, "ps_2w2p@1gbit": {**row, "link": "1gbit"}}}
    (tmp_path / "bench.json").write_text(json.dumps(report))
    drawing = importlib.util.find_spec("matplotlib") is not None  # the bench extra
    assert bench_report.main([str(tmp_path / "bench.json")]) == (0 if drawing else 1)
    printed = capsys.readouterr()
    assert "ps_2w2p@100mbit" in printed.out and "(what ps:0 sends): 1.250x" in printed.out
    if drawing:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert bench_report.NO_CHART in printed.err and not (tmp_path / "bench.png").exists()
    (tmp_path / "other.json").write_text("{}")
    assert bench_report.main([str(tmp_path / "other.json")]) == 2
    assert "not a report tools.bench wrote (KeyError" in capsys.readouterr().err


def test_a_record_is_printed_and_written_where_asked(tmp_path, capsys):
    out = tmp_path / "results" / "record.json"  # its folder made
    bench_report.emit({"command": "python -m tools.x", "rows": {"a": 1.5}}, out)
    printed = capsys.readouterr().out
    assert printed == out.read_text() and json.loads(printed)["rows"] == {"a": 1.5}
    bench_report.emit({"rows": {}}, None)
    assert json.loads(capsys.readouterr().out) == {"rows": {}}
