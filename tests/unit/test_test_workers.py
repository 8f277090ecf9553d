"""The test processes that scripts/test.sh runs side by side give their vLLM workers cores of
their own (tests/conftest.py)."""

import pytest

from tests.conftest import longest_first, unit_of, unit_of_work, worker_cores


def test_each_xdist_worker_binds_its_engines_to_a_core_of_its_own():
    assert [worker_cores(f"gw{i}", {0, 1}, "auto") for i in range(3)] == ["0", "1", "0"]
    assert worker_cores("gw1", {4, 6}, "auto") == "6"  # the cores this process may use


def test_outside_xdist_or_with_a_binding_chosen_vllm_binds_as_configured():
    assert worker_cores(None, {0, 1}, "auto") == "auto"
    assert worker_cores("master", {0, 1}, "auto") == "auto"
    assert worker_cores("gw1", {0, 1}, "nobind") == "nobind"
    assert worker_cores("gw1", {0, 1}, "0|1") == "0|1"


class _Item:
    def __init__(self, nodeid: str, group: str | None = None) -> None:
        self.nodeid = nodeid
        self._marks = [pytest.mark.xdist_group(group).mark] if group else []

    def iter_markers(self, name: str):
        return iter([m for m in self._marks if m.name == name])


def test_the_longest_files_and_groups_go_first_and_each_keeps_its_tests_together_in_order():
    items = [
        _Item("tests/a.py::one"),
        _Item("tests/pd/test_x.py::x", group="pd"),
        _Item("tests/b.py::one"),
        _Item("tests/a.py::two"),
        _Item("tests/pd/test_y.py::y", group="pd"),
        _Item("tests/c.py::one"),
    ]
    measured = {"tests/a.py": 10.0, "tests/b.py": 300.0}  # pd and c not measured: 20 s a test
    order = [item.nodeid for item in longest_first(items, measured)]
    assert order == [
        "tests/b.py::one",
        "tests/pd/test_x.py::x",
        "tests/pd/test_y.py::y",
        "tests/c.py::one",
        "tests/a.py::one",
        "tests/a.py::two",
    ]
    assert [unit_of_work(item) for item in items[:2]] == ["tests/a.py", "pd"]


def test_the_modules_of_a_folder_that_shares_its_engines_are_one_unit():
    assert (
        unit_of("tests/pd/test_a.py::test_one") == unit_of("tests/pd/test_b.py::test_two[x]") == "tests/pd/"
    )
    assert unit_of("tests/redis/test_a.py::test_one[p@q]") == "tests/redis/test_a.py"
    assert unit_of("tests/redis/test_a.py::test_one@shared") == "shared"


def test_durations_are_summed_per_unit_from_the_integration_report_only():
    from scripts.durations import unit_seconds

    report = [
        "============ slowest durations ============",
        "120.50s setup    tests/pd/test_pd_failures.py::test_down",
        "10.00s call     tests/pd/test_pd_serve.py::test_equal[tail]",
        "30.00s call     tests/redis/test_serve_remote.py::test_a",
        "2.50s teardown tests/redis/test_serve_remote.py::test_a",
        "not a duration line 5.00s call tests/x.py::y",
        "[test] ---- tests not marked integration (ran beside the above) ----",
        "99.00s call     tests/unit/test_whatif.py::test_w",
    ]
    assert unit_seconds(report) == {"tests/pd/": 130.5, "tests/redis/test_serve_remote.py": 32.5}


def test_every_unit_in_durations_json_is_a_test_file_or_folder_here():
    import json

    from tests.conftest import DURATIONS

    root = DURATIONS.parents[1]
    assert all((root / unit).exists() for unit in json.loads(DURATIONS.read_text()))
