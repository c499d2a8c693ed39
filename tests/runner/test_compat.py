"""runner/compat.py: PyTorch's private internals come from one place, for a declared torch range."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from runner import compat

ROOT = Path(__file__).resolve().parents[2]
# The brief's definition of "a PyTorch internal": a private torch attribute or module.
PRIVATE = re.compile(r"torch\._[a-zA-Z]|from torch\._|torch\.utils\._|torch\.fx\.experimental|_C\.")
_NOT_CODE = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}  # 3.12+ splits f-strings


def _code_without_comments_and_strings(path: Path) -> str:
    kept = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in _NOT_CODE:
            kept.append(tok.string)
    return " ".join(kept).replace(" . ", ".").replace(" .", ".").replace(". ", ".")


def test_private_torch_internals_are_imported_only_in_compat():
    offenders = []
    for path in sorted([*(ROOT / "runner").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        if path == ROOT / "runner" / "compat.py":
            continue
        found = PRIVATE.findall(_code_without_comments_and_strings(path))
        if found:
            offenders.append(f"{path.relative_to(ROOT)}: {sorted(set(found))}")
    assert not offenders, "use runner.compat instead:\n" + "\n".join(offenders)


def test_pyproject_declares_the_tested_torch_range():
    declared = re.findall(r'^\s*"(torch\b[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared == [f"torch{compat.TESTED_TORCH}"]


def test_this_torch_is_in_the_tested_range_and_needs_no_fallback():
    version = Version(torch.__version__.split("+")[0])
    assert version in SpecifierSet(compat.TESTED_TORCH)
    assert compat.FAKE_CACHE_FAST_PATHS
    if version >= Version("2.13"):  # the CI torch: every internal is there
        assert compat.FALLBACKS == {}
    else:  # 2.11: fake parameters take the dispatched path (same tensors)
        assert set(compat.FALLBACKS) <= {"FakeTensor(requires_grad=, _is_param=)"}


def test_a_missing_internal_names_itself_and_the_tested_range():
    stand_in = compat._missing("torch._C._not_there", "a test", AttributeError("no such attribute"))
    with pytest.raises(compat.MissingTorchInternal) as info:
        stand_in()
    message = str(info.value)
    assert "torch._C._not_there" in message and compat.TESTED_TORCH in message and torch.__version__ in message
    assert info.value.internal == "torch._C._not_there"
    assert isinstance(info.value, ImportError)  # callers that guarded imports keep working


def test_wrapped_internals_answer_like_torch():
    assert compat.sdp_priority_order() == list(torch._C._get_sdp_priority_order())
    assert compat.current_graph_task_id() == -1  # not in backward
    assert compat.outer_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert compat.outer_saved_tensors_hooks() is not None
    assert compat.has_compatible_shallow_copy_type(torch.empty(0), torch.empty(0))
    assert not compat.has_compatible_shallow_copy_type(torch.empty(0), torch.empty(0, device="meta"))
    assert compat.active_fake_mode() is None
    with compat.FakeTensorMode() as mode:
        assert compat.active_fake_mode() is mode
        assert compat.is_fake(torch.empty(2))
    assert not compat.is_fake(torch.empty(2))
    leaves = [1, torch.zeros(1), "x"]
    assert list(compat.tree_iter({"a": leaves[0], "b": (leaves[1], leaves[2])})) == leaves
