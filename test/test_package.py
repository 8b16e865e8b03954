"""The package's shape and its error contract.

No module of ``pippy.checkpoint`` imports, directly or through others, a
module that imports it back (a lazy import inside a function counts too: it
only hides the cycle). Rank 0's answers to folder questions
(``on_coordinator``) keep their error's type, and every error a public
function raises is importable from ``pippy.checkpoint``.
"""

import ast
import pickle
from pathlib import Path

import pytest

import pippy.checkpoint as checkpoint
from pippy.checkpoint import errors
from pippy.checkpoint.collectives import on_coordinator

PACKAGE = Path(checkpoint.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its source}."""
    files = {
        ".".join(
            ("pippy.checkpoint", *f.relative_to(PACKAGE).with_suffix("").parts)
        ).removesuffix(".__init__"): f
        for f in PACKAGE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + [base] * bool(base))
                targets |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle, as the path that closes it."""
    found, done = [], set()

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                found.append(path[path.index(target) :] + [target])
            elif target not in done:
                walk(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            walk(module, [module])
    return found


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "pippy.checkpoint.steps" in graph and len(graph) > 10  # it read them
    # A package's __init__ re-exports its modules: a module importing the
    # package that holds it closes no cycle that matters.
    graph = {m: {t for t in ts if not m.startswith(f"{t}.")} for m, ts in graph.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_a_bug_on_rank_0_keeps_its_type():
    def buggy():
        raise TypeError("a bug, not a folder problem")

    with pytest.raises(TypeError, match="a bug, not a folder problem"):
        on_coordinator("cannot list /x", buggy, None)


def test_a_checkpoint_error_on_rank_0_keeps_its_type():
    def missing():
        raise checkpoint.CheckpointNotFoundError("no step-7")

    with pytest.raises(checkpoint.CheckpointNotFoundError, match="^no step-7$"):
        on_coordinator("cannot read /x", missing, None)


def test_a_folder_error_on_rank_0_names_the_action_and_file(tmp_path):
    def unreadable():
        raise PermissionError(13, "Permission denied", str(tmp_path))

    with pytest.raises(checkpoint.CheckpointDirError) as e:
        on_coordinator(f"cannot list {tmp_path}", unreadable, None)
    assert str(e.value) == f"cannot list {tmp_path}: Permission denied ({tmp_path})"


def test_an_error_that_cannot_travel_is_named_on_the_other_ranks():
    class Unpicklable(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a} {b}")

    portable = errors.portable(Unpicklable(1, 2), "cannot list /x")
    assert type(portable) is checkpoint.CheckpointError
    assert str(portable) == "cannot list /x: Unpicklable on rank 0: 1 2"
    assert str(errors.portable(Unpicklable(1, 2))) == "Unpicklable: 1 2"
    copy = errors.portable(KeyError("k"), "cannot list /x")
    assert type(copy) is KeyError and pickle.dumps(copy) == pickle.dumps(KeyError("k"))


def test_a_folder_in_use_or_a_lost_lease_is_no_directory_error():
    assert not issubclass(checkpoint.CheckpointDirInUseError, NotADirectoryError)
    assert issubclass(checkpoint.CheckpointDirInUseError, checkpoint.CheckpointError)


def test_every_error_class_is_exported():
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, checkpoint.CheckpointError)
        and value.__module__ == errors.__name__
    }
    assert defined <= set(checkpoint.__all__), defined - set(checkpoint.__all__)
