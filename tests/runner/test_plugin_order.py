"""Per-phase plugin order: after/before across kinds, KINDS tie-break, cycles, describe()."""
from __future__ import annotations

import pytest

from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.plugin import KINDS, PHASES, Plugin, PluginSchedule, order_for_phase
from runner.resolved import resolve

RUN = resolve(compose_config(["train.device=cpu"]))  # ordering reads no setting of the run


def make(kind: str, name: str, phases: tuple[str, ...] = ("wrap_execution",), after=(), before=()) -> Plugin:
    """A plugin class implementing only ``phases`` (not registered: tests leave the registry alone)."""
    body = {"kind": kind, "name": name, "after": tuple(after), "before": tuple(before)}
    for ph in phases:
        body[ph] = lambda self, ctx, *args, _ph=ph: ctx.append((self.key, _ph))
    return type(f"P_{kind}_{name}", (Plugin,), body)(None, RUN)


def keys(plugins):
    return [p.key for p in plugins]


def test_tie_break_follows_kinds_not_input_order():
    plugins = [make(k, "x") for k in reversed(KINDS)]
    assert keys(order_for_phase(plugins, "wrap_execution")) == [f"{k}/x" for k in KINDS]


def test_after_and_before_across_kinds():
    # allocator would come first by KINDS; "after tiling" moves it behind tiling.
    a = make("allocator", "late", after=("tiling",))
    t = make("tiling", "vae")
    c = make("checkpoint", "blocks")
    assert keys(order_for_phase([a, t, c], "wrap_execution")) == ["checkpoint/blocks", "tiling/vae", "allocator/late"]
    # "before" by full key: tiling/vae must precede offload/stream.
    o = make("offload", "stream")
    t2 = make("tiling", "vae", before=("offload/stream",))
    q = make("quantization", "int8")
    assert keys(order_for_phase([o, t2, q], "wrap_execution")) == ["quantization/int8", "tiling/vae", "offload/stream"]


def test_reference_to_an_absent_plugin_is_ignored():
    c = make("checkpoint", "blocks", after=("offload",))
    a = make("allocator", "default")
    assert keys(order_for_phase([c, a], "wrap_execution")) == ["allocator/default", "checkpoint/blocks"]
    # a "kind/name" reference only matches that name
    c2 = make("checkpoint", "blocks", before=("allocator/other",))
    assert keys(order_for_phase([c2, a], "wrap_execution")) == ["allocator/default", "checkpoint/blocks"]


def test_cycle_is_a_user_error_naming_both_plugins_and_the_phase():
    o = make("offload", "stream", after=("checkpoint",))
    c = make("checkpoint", "blocks", after=("offload",))
    with pytest.raises(UserError, match=r"checkpoint/blocks, offload/stream declare a circular order in phase 'wrap_execution'"):
        order_for_phase([o, c], "wrap_execution")
    # the same cycle through before/after mixed
    o2 = make("offload", "stream", before=("tiling",))
    t = make("tiling", "vae", before=("offload/stream",))
    with pytest.raises(UserError, match="circular"):
        PluginSchedule.build([o2, t])


def test_constraints_only_apply_where_both_implement_the_phase():
    # offload implements only place_models, so checkpoint's "after offload" constrains nothing
    # in wrap_execution, and a cycle that cannot happen in any single phase is no error.
    o = make("offload", "stream", phases=("place_models",), after=("checkpoint",))
    c = make("checkpoint", "blocks", phases=("wrap_execution",), after=("offload",))
    sched = PluginSchedule.build([o, c])
    assert keys(sched.by_phase["place_models"]) == ["offload/stream"]
    assert keys(sched.by_phase["wrap_execution"]) == ["checkpoint/blocks"]


def test_partial_plugins_appear_only_in_their_phases_and_run_in_order():
    alloc = make("allocator", "default", phases=("configure_process",))
    quant = make("quantization", "int8", phases=("transform_models", "teardown"))
    ck = make("checkpoint", "blocks", phases=("wrap_execution", "teardown"), before=("quantization",))
    empty = make("tiling", "none", phases=())
    sched = PluginSchedule.build([empty, ck, quant, alloc])
    assert set(sched.by_phase) == set(PHASES)
    assert keys(sched.by_phase["configure_process"]) == ["allocator/default"]
    assert keys(sched.by_phase["transform_models"]) == ["quantization/int8"]
    assert keys(sched.by_phase["wrap_execution"]) == ["checkpoint/blocks"]
    assert keys(sched.by_phase["teardown"]) == ["checkpoint/blocks", "quantization/int8"]
    for ph in ("place_models", "wrap_optimizer", "on_step_start", "on_step_end", "on_oom"):
        assert sched.by_phase[ph] == []
    assert not empty.implements("configure_process")
    assert ck.implements("teardown") and not ck.implements("on_oom")

    calls: list = []
    sched.run("teardown", calls)
    sched.run("on_step_end", calls, 3)
    assert calls == [("checkpoint/blocks", "teardown"), ("quantization/int8", "teardown")]


def test_describe():
    alloc = make("allocator", "default", phases=("configure_process",))
    ck = make("checkpoint", "blocks", phases=("wrap_execution", "teardown"))
    off = make("offload", "stream", phases=("wrap_execution", "on_oom"))
    text = PluginSchedule.build([ck, alloc, off]).describe()
    assert text.splitlines() == [
        f"  {'configure_process':<18} allocator/default",
        f"  {'wrap_execution':<18} offload/stream -> checkpoint/blocks",
        f"  {'on_oom':<18} offload/stream",
        f"  {'teardown':<18} checkpoint/blocks",
    ]
    assert PluginSchedule.build([make("tiling", "none", phases=())]).describe() == "  (no plugin phases)"


def test_kind_none_selects_no_plugin():
    # `<kind>=none` used to build a do-nothing "none" plugin; it now selects no plugin at all.
    from runner.parts import build_plugins

    cfg = compose_config([f"{kind}=none" for kind in KINDS] + ["train.device=cpu"])
    sched = build_plugins(cfg, resolve(cfg))
    assert sched.plugins == []
    assert all(sched.by_phase[ph] == [] for ph in PHASES)
    assert sched.describe() == "  (no plugin phases)"


def test_builtin_schedule_orders_real_plugins():
    import runner.plugins  # noqa: F401
    from runner import registry

    cfg = compose_config(["checkpoint=blocks", "train.device=cpu"])
    run = resolve(cfg)
    ps = [registry.get_plugin(k, n)(cfg[k][n], run) for k, n in [("checkpoint", "blocks"), ("allocator", "default")]]
    sched = PluginSchedule.build(ps)
    assert keys(sched.by_phase["configure_process"]) == ["allocator/default"]
    assert keys(sched.by_phase["claim_modules"]) == ["checkpoint/blocks"]
    assert keys(sched.by_phase["wrap_execution"]) == ["checkpoint/blocks"]
    # checkpointing is undone through ctx.hooks (ctx.teardown), not by a teardown phase of its own
    assert sched.by_phase["teardown"] == []


def test_an_optional_module_name_is_taken_when_built_and_skipped_when_not():
    # "name?" lets a preset name a module only some trainers build (a preset quantizing its text encoder
    # must still compose with a trainer that has none); a plain unknown name stays an error.
    from torch import nn

    from runner.trainer import ModelSet

    plugin = make("quantization", "nf4")
    built = ModelSet({"transformer": nn.Linear(2, 2), "text_encoder": nn.Linear(2, 2)})
    other = ModelSet({"denoiser": nn.Linear(2, 2)})
    assert plugin.known_modules(built, ["text_encoder?", "transformer"]) == ["text_encoder", "transformer"]
    assert plugin.known_modules(other, ["text_encoder?"]) == []
    with pytest.raises(UserError, match="'text_encoder', which the trainer does not build"):
        plugin.known_modules(other, ["text_encoder"])


def test_a_declared_requirement_is_checked_when_the_schedule_is_built():
    needy = type("P_needy", (Plugin,), {"kind": "tiling", "name": "needy", "requires": ("checkpoint/blocks",)})(None, RUN)
    with pytest.raises(UserError, match=r"tiling=needy needs checkpoint=blocks selected too"):
        PluginSchedule.build([needy, make("checkpoint", "other")])
    assert keys(PluginSchedule.build([needy, make("checkpoint", "blocks")]).plugins) == ["tiling/needy", "checkpoint/blocks"]


def test_a_conflict_is_read_from_either_plugins_declaration():
    from runner.parts import idle_parts
    from runner.context import RunContext

    why = "the two cannot share a module"
    a = type("P_a", (Plugin,), {"kind": "offload", "name": "a", "conflicts": {("move", "squash"): why}})(None, RUN)
    b = make("quantization", "b")
    for first, second in (((a, "move"), (b, "squash")), ((b, "squash"), (a, "move"))):
        ctx = RunContext(run=RUN, schedule=PluginSchedule.build([a, b]), **idle_parts(RUN))
        ctx.claim("unet", first[1], first[0].key)
        with pytest.raises(UserError, match=rf"both claim 'unet' \({second[1]} and {first[1]}\): {why}"):
            ctx.claim("unet", second[1], second[0].key)
    ctx = RunContext(run=RUN, schedule=PluginSchedule.build([a, b]), **idle_parts(RUN))
    ctx.claim("unet", "move", a.key)
    ctx.claim("unet", "other", b.key)  # undeclared pairs may share a module
    assert len(ctx.facts.claims) == 2
