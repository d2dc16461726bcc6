"""Tests mirror the code: every product module has its own test file, named after it.

The scheme follows import names without the leading ``prefixmesh.``: the module
``prefixmesh.<dir>.<module>`` (repository file ``<dir>/<module>.py``, ``<dir>`` one of
``node``, ``overlay``, ``inference``, ``bench`` or a folder below one) is tested by
``tests/<dir>/test_<module>.py``, or by one or more files ``tests/<dir>/test_<module>_<topic>.py``
when it has several (the topic says which part: ``test_planner_differential.py``,
``test_daemon_lifecycle.py``). The top package's own modules, ``prefixmesh.<module>``
(``prefixmesh/cli.py``, ``prefixmesh/__main__.py``), are tested at the top of ``tests/``:
``tests/test_cli.py``, ``tests/test___main__.py``. ``__init__.py`` files are not modules of
their own. Tests about no one module live beside them: multi-node tests in
``tests/swarm/``, the tree's own rules at the top (``test_purity.py``, this file); helpers
are the ``_*.py`` files at the top of ``tests/``.

Two folder rules keep collection and the helper scripts working, and are checked here too:
the test folders have no ``__init__.py`` (pytest's default ``prepend`` import mode imports
each test file under its basename), so no two test files may share a basename (a module
whose basename another package also uses, ``overlay/gossip.py`` and ``bench/gossip.py``,
may need a topic suffix on one side); and no folder ``tests/prefixmesh/``: scripts run from
``tests/`` (the fork server, ``_fault_node.py``) have ``tests/`` first on ``sys.path``, where
such a folder is a namespace package that shadows the installed ``prefixmesh``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PACKAGE_DIRS = ("node", "overlay", "inference", "bench", "prefixmesh")

# Modules allowed to have no mirrored test file, each with the reason. Keep it empty:
# a module that cannot be run cheaply still has pure parts (arguments, tables, the files
# it writes) to test. An entry here must say why, and should carry an issue number.
ALLOWED_WITHOUT_TEST: dict[str, str] = {}


def product_modules() -> list[Path]:
    """Every product module, relative to the repository root (``__init__.py`` excluded)."""
    out: list[Path] = []
    for d in PACKAGE_DIRS:
        out.extend(p.relative_to(ROOT) for p in (ROOT / d).rglob("*.py")
                   if p.name != "__init__.py")
    return sorted(out)


def mirrored_tests(module: Path) -> list[Path]:
    """The test files of ``module`` under the scheme (empty when it has none)."""
    # prefixmesh/X.py is the top package: its tests are at the top of tests/
    folder = TESTS if module.parent == Path("prefixmesh") else TESTS / module.parent
    stem = module.stem
    # a sibling module whose name extends this one's (bench/membership.py and
    # bench/membership_swarm.py) owns its own test files: they do not count for this one
    longer = [p.stem for p in (ROOT / module.parent).glob(f"{stem}_*.py")]
    return sorted(
        p for p in folder.glob(f"test_{stem}*.py")
        if (p.stem == f"test_{stem}" or p.stem.startswith(f"test_{stem}_"))
        and not any(p.stem == f"test_{o}" or p.stem.startswith(f"test_{o}_") for o in longer))


def test_the_walk_sees_the_packages():
    mods = {str(m) for m in product_modules()}
    # a sanity floor, so that a broken walk cannot pass by finding nothing
    assert {"overlay/core/planner.py", "node/daemon.py", "prefixmesh/cli.py",
            "inference/engine.py", "bench/sim.py"} <= mods
    assert not any(m.endswith("__init__.py") for m in mods)


def test_every_product_module_has_a_mirrored_test_file():
    missing = [str(m) for m in product_modules()
               if not mirrored_tests(m) and str(m) not in ALLOWED_WITHOUT_TEST]
    assert not missing, (
        "product modules without a test file tests/<dir>/test_<module>[_<topic>].py "
        "(see tests/test_layout.py for the scheme): " + ", ".join(missing))


def test_the_allow_list_names_real_untested_modules_with_reasons():
    for mod, reason in ALLOWED_WITHOUT_TEST.items():
        assert (ROOT / mod).is_file(), f"{mod} is allowed without a test but does not exist"
        assert not mirrored_tests(Path(mod)), f"{mod} has a test now: drop it from the list"
        assert reason.strip(), f"{mod} is allowed without a test but no reason is given"


def test_test_file_basenames_are_unique():
    # no __init__.py in tests/*: pytest imports every test file by its basename
    seen: dict[str, list[str]] = defaultdict(list)
    for p in TESTS.rglob("test_*.py"):
        seen[p.name].append(str(p.relative_to(ROOT)))
    dupes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not dupes, f"test files sharing a basename break pytest's collection: {dupes}"


def test_no_test_folder_shadows_the_package():
    # sys.path[0] is tests/ for the scripts there: tests/prefixmesh/ would be imported
    # instead of the real package (the fork server then fails to start)
    assert not (TESTS / "prefixmesh").exists(), \
        "tests/prefixmesh/ shadows the prefixmesh package: tests of prefixmesh/X.py are tests/test_X.py"
