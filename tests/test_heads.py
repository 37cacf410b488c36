"""Head selection: every accepted form resolves to the right per-layer selections (LayerHeads);
every invalid value is a ConfigError (a ValueError) whose message names the value that was given;
settings sort in one order; a recipe's config field refuses a bad value when it is parsed."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lapheads import ConfigError, LaplacianHeads, LayerHeads, head_mask
from lapheads.engine.config import from_dict, load_config
from lapheads.heads import DEFAULT_LAPLACIAN_HEADS
from lapheads.heads_config import heads_field


def _masks(spec, n_layers, n_heads):
    return [list(sel.flags) for sel in LaplacianHeads(spec).resolve(n_layers, n_heads)]


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
    assert _masks([[0], [], [1, 3]], 3, 4) == [[True, False, False, False], [False] * 4, [False, True, False, True]]
    assert LaplacianHeads([[], []]).is_none()


def test_copy_label_config_roundtrip():
    for spec in [3, "all", "none", [1, 2], [[0], [1, 2]]]:
        lh = LaplacianHeads(spec)
        assert LaplacianHeads(lh) == lh
        assert LaplacianHeads(lh.to_config()) == lh
        assert isinstance(lh.label(), str) and lh.label()
        # the saved form rebuilds the same heads: compared on the resolved flags, not on __eq__/__hash__
        assert LaplacianHeads(lh.to_config()).resolve(2, 4) == lh.resolve(2, 4)
    assert LaplacianHeads(LaplacianHeads([1, 2]).to_config()).resolve(2, 4) == [
        LayerHeads((False, False, False, True)),
        LayerHeads((False, False, True, True)),
    ]
    assert LaplacianHeads(3).label() == "k=3"
    assert LaplacianHeads([[0], [1, 2]]).label() == "per-layer:1,2"


def test_layer_mask():
    lh = LaplacianHeads([1, 2])
    assert lh.layer_mask(1, 2, 3).tolist() == [False, True, True]


@settings(max_examples=50, deadline=None)
@given(n_heads=st.integers(1, 16), data=st.data())
def test_int_k_property(n_heads, data):
    k = data.draw(st.integers(0, n_heads))
    sel = LaplacianHeads(k).resolve(2, n_heads)[0]
    assert sel.count == k == int(sel.mask().sum())
    # trailing: once a head is Laplacian, every later head is too
    assert list(sel.flags) == sorted(sel.flags)
    assert sel.indices == tuple(range(n_heads - k, n_heads))


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


# LayerHeads: one layer's resolved selection, the form the operator branches on
def test_layer_heads_of_every_form():
    # each form with the flags written out by hand (the trailing-k convention: the LAST k heads)
    for spec, want in [
        (0, [False, False, False, False]),
        (2, [False, False, True, True]),
        ("all", [True, True, True, True]),
        ("none", [False, False, False, False]),
        ([0, 2], [True, False, True, False]),
        ((True, False, True, False), [True, False, True, False]),
        (LaplacianHeads(1), [False, False, False, True]),
        (torch.tensor([True, False, False, True]), [True, False, False, True]),
        (LayerHeads((True, False, False, False)), [True, False, False, False]),
    ]:
        sel = LayerHeads.of(spec, 4)
        assert isinstance(sel.flags, tuple) and all(type(f) is bool for f in sel.flags)
        assert list(sel.flags) == want, spec
    lh = LaplacianHeads([[1], [0, 2]])
    assert lh.resolve(2, 3) == [LayerHeads((False, True, False)), LayerHeads((True, False, True))]
    assert lh.layer_mask(1, 2, 3).tolist() == [True, False, True]


def test_layer_heads_properties():
    sel = LayerHeads([False, True, False, True])  # a list becomes a tuple
    assert sel.flags == (False, True, False, True) and sel.n_heads == 4
    assert sel.any and not sel.all and sel.count == 2 and sel.indices == (1, 3)
    none, every = LayerHeads((False,) * 3), LayerHeads((True,) * 3)
    assert (none.any, none.all, none.count, none.indices) == (False, False, 0, ())
    assert (every.any, every.all, every.count, every.indices) == (True, True, 3, (0, 1, 2))


def test_layer_heads_is_frozen_and_hashable():
    a, b = LayerHeads((True, False)), LayerHeads((True, False))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != LayerHeads((False, True))
    a.mask()  # a cached mask does not change equality or hash
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.flags = (False, False)


def test_layer_heads_mask_is_cached_per_device_and_usable_after_inference_mode():
    sel = LayerHeads((False, True, True))
    with torch.inference_mode():
        m = sel.mask()
    assert m.dtype == torch.bool and m.tolist() == [False, True, True]
    assert sel.mask("cpu") is m and sel.mask(torch.device("cpu")) is m
    assert not m.is_inference()  # built outside inference mode: a later training step may save it
    x = torch.randn(3, requires_grad=True)
    torch.where(m, x, -x).sum().backward()
    assert x.grad.tolist() == [-1.0, 1.0, 1.0]


@pytest.mark.parametrize("flags", [(), (1, 0), (True, 0), "TF", None])
def test_layer_heads_refuses_non_bool_flags(flags):
    _raises(lambda: LayerHeads(flags), "LayerHeads(flags=", "tuple of bools")


def test_layer_heads_refuses_tensor_flags():
    _raises(lambda: LayerHeads(torch.tensor([True])), "LayerHeads.of")


def test_layer_heads_of_errors():
    _raises(lambda: LayerHeads.of(5, 4), "5")
    _raises(lambda: LayerHeads.of(torch.tensor([1, 0]), 2), "torch.int64")
    _raises(lambda: LayerHeads.of([True], 2), "[True]")
    _raises(lambda: LayerHeads.of(LayerHeads((True, False)), 3), "2 heads", "expected 3")
    _raises(lambda: LayerHeads.of(LaplacianHeads("learn"), 3), "learnable mixing")


def test_resolve_returns_layer_heads_for_every_kind():
    for spec in [0, 2, "all", "none", [0, 1], [[0], [1, 2]]]:
        sels = LaplacianHeads(spec).resolve(2, 3)
        assert len(sels) == 2 and all(type(s) is LayerHeads and s.n_heads == 3 for s in sels)


# ----------------------------------------------------------------------------- sort key
def test_sort_key_orders_settings():
    want = [
        "k=0",
        "k=1",
        "k=2",
        "k=10",
        "all",
        "per-layer:0,2",
        "per-layer:1,2",
        "learn:standard",
        "learn:1",
        "learn:3",
        "learn:laplacian",
    ]
    shuffled = [want[i] for i in (7, 3, 10, 0, 5, 8, 2, 9, 4, 1, 6)]
    assert sorted(shuffled, key=LaplacianHeads.sort_key) == want
    # the same order from specs, LaplacianHeads and the labels report.py writes ("none" = "k=0")
    specs = ["learn", 2, [[0], [1]], "none", "all", 1, [1, 0], LaplacianHeads.learn("laplacian")]
    assert [LaplacianHeads(s).label() for s in sorted(specs, key=LaplacianHeads.sort_key)] == [
        "none",
        "k=1",
        "k=2",
        "all",
        "per-layer:1,0",
        "per-layer:1,1",
        "learn:standard",
        "learn:laplacian",
    ]
    assert LaplacianHeads.sort_key("none") == LaplacianHeads.sort_key("k=0") == LaplacianHeads.sort_key(0)
    assert LaplacianHeads.sort_key("k=all") == LaplacianHeads.sort_key("all")
    assert LaplacianHeads.sort_key("k=learn") == LaplacianHeads.sort_key(LaplacianHeads.learn())


@pytest.mark.parametrize("text", ["²", "learn:²", "٣", "--3", "k=²"])
def test_non_ascii_digits_are_one_config_error_not_a_crash(text):
    """'²'.isdigit() is True but int('²') raises ValueError (found by the property test below);
    '٣' would have been read as 3. Only ASCII digits are a head count."""
    from lapheads.heads import is_count

    with pytest.raises(ConfigError, match="laplacian_heads"):
        LaplacianHeads(text.removeprefix("k="))
    assert LaplacianHeads.sort_key(text)[0] == 4  # an unknown label: sorted last, by its text
    assert not is_count(text) and is_count("3") and is_count(3) and not is_count(True)


def test_sort_key_puts_unknown_labels_last_by_text():
    labels = ["zeta", "k=3", "alpha", "learn:laplacian", "k=0"]
    assert sorted(labels, key=LaplacianHeads.sort_key) == ["k=0", "k=3", "learn:laplacian", "alpha", "zeta"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(0, 12),
            st.sampled_from(["all", "none", "learn", "learn:laplacian", "learn:2"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=3),
            st.lists(st.lists(st.integers(0, 3), max_size=2, unique=True), min_size=1, max_size=3),
            st.text(max_size=4),
        ),
        max_size=8,
    )
)
def test_sort_key_is_total_and_deterministic(specs):
    keys = [LaplacianHeads.sort_key(s) for s in specs]  # never raises, also on odd text
    assert sorted(keys) == sorted(reversed(keys))  # any two keys compare (no TypeError)
    for s in specs:
        assert LaplacianHeads.sort_key(s) == LaplacianHeads.sort_key(s)


# ----------------------------------------------------------------------------- config field
@dataclasses.dataclass
class _ModelCfg:
    laplacian_heads: Any = heads_field()


@dataclasses.dataclass
class _Cfg:
    model: _ModelCfg = dataclasses.field(default_factory=_ModelCfg)


def test_heads_field_default_and_accepted_values():
    assert _ModelCfg().laplacian_heads == DEFAULT_LAPLACIAN_HEADS == 0
    for value in [3, "all", "none", None, [0, 2], [[0], [1, 2]], "learn:laplacian"]:
        assert from_dict(_Cfg, {"model": {"laplacian_heads": value}}).model.laplacian_heads == value  # kept as written
    cfg = load_config(_Cfg, overrides=["model.laplacian_heads=[1,2]"])
    assert cfg.model.laplacian_heads == [1, 2]


@pytest.mark.parametrize(
    "value, needle",
    [
        ("alll", "'alll' is not understood"),
        (-1, "-1 is negative"),
        ([1, -2], "[1]=-2 is negative"),
        (2.5, "type float"),
        (True, "type bool"),
        ("learn:x", "learnable initialisation"),
    ],
)
def test_heads_field_refuses_bad_values_at_parse_time(value, needle):
    msg = _raises(lambda: from_dict(_Cfg, {"model": {"laplacian_heads": value}}), needle)
    assert msg.startswith("model.laplacian_heads") and "\n" not in msg


def test_heads_field_refuses_bad_override_naming_the_key():
    msg = _raises(lambda: load_config(_Cfg, overrides=["model.laplacian_heads=some"]), "'some'")
    assert msg.startswith("model.laplacian_heads='some' is not understood")


def test_heads_field_defaults():
    @dataclasses.dataclass
    class Cfg:
        heads: Any = heads_field([1, 2])

    a, b = Cfg(), Cfg()
    assert a.heads == [1, 2] and a.heads is not b.heads  # a list default is copied per config
    _raises(lambda: heads_field("alll"), "'alll'")  # a bad default fails where it is declared


def test_parse_config_value_turns_laplacian_heads_into_its_config_form():
    assert LaplacianHeads.parse_config_value(LaplacianHeads.learn(2), "k") == "learn:2"
    _raises(lambda: LaplacianHeads.parse_config_value({"k": 1}, "model.laplacian_heads"), "model.laplacian_heads=")


def test_head_mask_and_layer_mask_are_deprecated_for_layer_heads_mask():
    """One way to get a mask stays: LayerHeads.mask(); the two older ones warn and still work."""
    with pytest.deprecated_call(match=r"LayerHeads.of\(spec, n_heads\).mask\(device\)"):
        old = head_mask([0, 2], 3)
    assert old.tolist() == LayerHeads.of([0, 2], 3).mask().tolist() == [True, False, True]
    with pytest.deprecated_call(match=r"resolve\(n_layers, n_heads\)\[layer\].mask\(\)"):
        old = LaplacianHeads([1, 2]).layer_mask(1, 2, 3)
    assert old.tolist() == LaplacianHeads([1, 2]).resolve(2, 3)[1].mask().tolist()
