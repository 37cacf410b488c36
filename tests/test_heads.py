"""Head selection: every accepted form resolves to the right masks; every invalid value is a
ConfigError (a ValueError) whose message names the value that was given."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lapheads import ConfigError, LaplacianHeads, head_mask


def _masks(spec, n_layers, n_heads):
    return [m.tolist() for m in LaplacianHeads(spec).resolve(n_layers, n_heads)]


# ----------------------------------------------------------------------------- accepted forms
def test_int_is_trailing_k_in_every_layer():
    assert _masks(2, 3, 4) == [[False, False, True, True]] * 3
    assert LaplacianHeads(2).counts(3, 4) == [2, 2, 2]


@pytest.mark.parametrize("spec", ["all", "ALL", " all "])
def test_all(spec):
    assert _masks(spec, 2, 3) == [[True] * 3] * 2


@pytest.mark.parametrize("spec", ["none", "None", None, 0, "0"])
def test_none_forms(spec):
    lh = LaplacianHeads(spec)
    assert _masks(spec, 2, 3) == [[False] * 3] * 2
    assert lh.is_none()


def test_numeric_string_is_an_int():
    assert LaplacianHeads("3") == LaplacianHeads(3)
    assert _masks("3", 1, 4) == [[False, True, True, True]]


def test_per_layer_counts():
    assert _masks([0, 1, 3], 3, 3) == [[False] * 3, [False, False, True], [True] * 3]
    assert LaplacianHeads((0, 1, 3)).counts(3, 3) == [0, 1, 3]
    assert LaplacianHeads([0, 0]).is_none() and not LaplacianHeads([0, 1]).is_none()


def test_per_layer_indices():
    assert _masks([[0], [], [1, 3]], 3, 4) == [
        [True, False, False, False], [False] * 4, [False, True, False, True]]
    assert LaplacianHeads([[], []]).is_none()


def test_copy_label_config_roundtrip():
    for spec in [3, "all", "none", [1, 2], [[0], [1, 2]]]:
        lh = LaplacianHeads(spec)
        assert LaplacianHeads(lh) == lh
        assert LaplacianHeads(lh.to_config()) == lh
        assert isinstance(lh.label(), str) and lh.label()
        assert hash(LaplacianHeads(lh.to_config())) == hash(lh)
    assert LaplacianHeads(3).label() == "k=3"
    assert LaplacianHeads([[0], [1, 2]]).label() == "per-layer:1,2"


def test_layer_mask():
    lh = LaplacianHeads([1, 2])
    assert lh.layer_mask(1, 2, 3).tolist() == [False, True, True]


@settings(max_examples=50, deadline=None)
@given(n_heads=st.integers(1, 16), data=st.data())
def test_int_k_property(n_heads, data):
    k = data.draw(st.integers(0, n_heads))
    m = LaplacianHeads(k).resolve(2, n_heads)[0]
    assert int(m.sum()) == k
    # trailing: once a head is Laplacian, every later head is too
    assert m.tolist() == sorted(m.tolist())


# head_mask: one layer
def test_head_mask_forms():
    assert head_mask(2, 4).tolist() == [False, False, True, True]
    assert head_mask("all", 2).tolist() == [True, True]
    assert head_mask("none", 2).tolist() == [False, False]
    assert head_mask([0, 2], 3).tolist() == [True, False, True]
    assert head_mask((1,), 3).tolist() == [False, True, False]
    assert head_mask([True, False, True], 3).tolist() == [True, False, True]
    t = torch.tensor([False, True])
    assert head_mask(t, 2).tolist() == [False, True]
    assert head_mask(LaplacianHeads(1), 3).tolist() == [False, False, True]
    assert head_mask([], 3).tolist() == [False] * 3
    assert head_mask(1, 3, device="cpu").device.type == "cpu"


# ----------------------------------------------------------------------------- invalid values
def _raises(fn, *needles):
    with pytest.raises(ValueError) as ei:
        fn()
    assert isinstance(ei.value, ConfigError)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in error message {msg!r}"
    return msg


@pytest.mark.parametrize("k", [5, 100])
def test_k_greater_than_heads(k):
    _raises(lambda: LaplacianHeads(k).resolve(2, 4), str(k), "4")
    _raises(lambda: head_mask(k, 4), str(k))


@pytest.mark.parametrize("k", [-1, "-2"])
def test_negative(k):
    _raises(lambda: LaplacianHeads(k), str(k).lstrip("'"))


def test_negative_in_per_layer_list():
    _raises(lambda: LaplacianHeads([1, -3]), "-3")
    _raises(lambda: LaplacianHeads([[0], [-1]]), "-1")


def test_per_layer_count_too_large():
    _raises(lambda: LaplacianHeads([1, 9]).resolve(2, 4), "9", "[1]")


@pytest.mark.parametrize("spec", [[1, 2], [[0], [1], [2]]])
def test_list_length_mismatch(spec):
    _raises(lambda: LaplacianHeads(spec).resolve(4, 4), repr(spec), str(len(spec)), "4 layers")


def test_duplicate_index():
    _raises(lambda: LaplacianHeads([[1, 1]]), "[1, 1]", "duplicate")
    _raises(lambda: head_mask([2, 2], 4), "[2, 2]")


def test_index_out_of_range():
    _raises(lambda: LaplacianHeads([[0], [4]]).resolve(2, 4), "4", "0..3")
    _raises(lambda: head_mask([7], 4), "7")


@pytest.mark.parametrize("spec", [2.5, {"k": 1}, object, b"all"])
def test_wrong_type(spec):
    _raises(lambda: LaplacianHeads(spec), repr(spec), type(spec).__name__)


@pytest.mark.parametrize("spec", [True, False])
def test_bool_is_rejected(spec):
    _raises(lambda: LaplacianHeads(spec), repr(spec), "bool")


@pytest.mark.parametrize("spec", [[True, 1], [1, "a"], [[0], 1], [1.5]])
def test_mixed_lists(spec):
    _raises(lambda: LaplacianHeads(spec), repr(spec))


@pytest.mark.parametrize("spec", [[[True]], [[0.5]], [["1"]]])
def test_non_int_index(spec):
    _raises(lambda: LaplacianHeads(spec), repr(spec[0][0]))


@pytest.mark.parametrize("spec", ["some", "3 heads", ""])
def test_unknown_string(spec):
    _raises(lambda: LaplacianHeads(spec), repr(spec))


def test_bad_model_shape():
    _raises(lambda: LaplacianHeads(1).resolve(0, 4), "n_layers=0")
    _raises(lambda: LaplacianHeads(1).resolve(2, 0), "n_heads=0")


def test_head_mask_tensor_errors():
    _raises(lambda: head_mask(torch.tensor([0, 1]), 2), "torch.int64")
    _raises(lambda: head_mask(torch.tensor([True, False, True]), 2), "(3,)", "(2,)")


def test_head_mask_bool_list_wrong_length():
    _raises(lambda: head_mask([True, False], 3), "[True, False]", "3")


def test_head_mask_rejects_per_layer_selection():
    _raises(lambda: head_mask(LaplacianHeads([1, 2]), 4), "[1, 2]", "per-layer")


def test_errors_are_plain_value_errors_for_callers():
    with pytest.raises(ValueError, match=re.escape("laplacian_heads=7")):
        LaplacianHeads(7).resolve(1, 3)


# head_flags / resolve_flags: the pure-Python twins the operator branches on
def test_flags_agree_with_masks():
    for spec in [0, 2, "all", "none", [0, 2], (True, False, True, False), LaplacianHeads(1),
                 torch.tensor([True, False, False, True])]:
        from lapheads.heads import head_flags
        flags = head_flags(spec, 4)
        assert isinstance(flags, tuple) and all(type(f) is bool for f in flags)
        assert list(flags) == head_mask(spec, 4).tolist()
    lh = LaplacianHeads([[1], [0, 2]])
    assert lh.resolve_flags(2, 3) == [(False, True, False), (True, False, True)]
    assert [m.tolist() for m in lh.resolve(2, 3)] == [list(f) for f in lh.resolve_flags(2, 3)]


def test_flags_errors_match_mask_errors():
    from lapheads.heads import head_flags
    _raises(lambda: head_flags(5, 4), "5")
    _raises(lambda: head_flags(torch.tensor([1, 0]), 2), "torch.int64")
    _raises(lambda: head_flags([True], 2), "[True]")
