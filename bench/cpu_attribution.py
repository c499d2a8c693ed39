"""Charge a cProfile's CPU time to the packages (and their functions) that caused it.

cProfile's exclusive time (tottime) puts a conv kernel under ``{built-in method torch.conv2d}`` and
the file-system probing of an import check under ``importlib``, which says little about who asked for
the work. Here every builtin, standard-library and import-hook function hands its exclusive time up
to the nearest calling function that belongs to a package (a site-packages distribution, or a
top-level folder of this checkout such as runner/ or bench/), split by the callers' shares of its
cumulative time. The result answers "which library's code made this CPU time happen", which is what
comparing two loops that do the same tensor work needs. The split by shares is an approximation when
one standard-library function serves several callers at different costs per call.
"""
from __future__ import annotations

import cProfile
import pstats
from pathlib import Path

Func = tuple[str, int, str]  # pstats' key: (file, line, function name)


def package(func: Func, root: Path) -> str | None:
    """The owner of a profiled function: its site-packages name, or the top folder under ``root``
    (runner, plugins, bench); None for builtins, the standard library and import hooks."""
    path = func[0]
    if "site-packages/" in path:
        name = path.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
        return None if name.startswith("_") else name  # _distutils_hack, __editable___*_finder: import hooks
    where = Path(path).resolve() if path.startswith("/") else None
    return where.relative_to(root).parts[0] if where is not None and root in where.parents else None


def attribute(prof: cProfile.Profile, root: Path) -> dict[Func, float]:
    """Exclusive CPU seconds per owning function (see the module docstring)."""
    stats: dict = pstats.Stats(prof).stats  # func -> (calls, primitive calls, tottime, cumtime, callers)
    memo: dict[Func, dict[Func, float]] = {}

    def owners(func: Func, seen: frozenset = frozenset()) -> dict[Func, float]:
        callers = stats.get(func, (0, 0, 0, 0, {}))[4]
        if package(func, root) is not None or not callers or func in seen:
            return {func: 1.0}
        if func not in memo:
            total, shares = sum(v[3] for v in callers.values()), {}
            for caller, v in callers.items():
                for owner, w in owners(caller, seen | {func}).items():
                    shares[owner] = shares.get(owner, 0.0) + w * (v[3] / total if total else 1 / len(callers))
            memo[func] = shares
        return memo[func]

    totals: dict[Func, float] = {}
    for func, (_, _, tottime, _, _) in stats.items():
        for owner, w in owners(func).items():
            totals[owner] = totals.get(owner, 0.0) + w * tottime
    return totals


def by_owner(prof: cProfile.Profile, root: Path, scale: float = 1.0) -> dict[str, dict[str, float]]:
    """``{"package": {name: s}, "function": {"name: function": s}}``, seconds times ``scale``;
    time no package claims (a profile's top frames) is listed as ``other``."""
    out: dict[str, dict[str, float]] = {"package": {}, "function": {}}
    for func, sec in attribute(prof, root).items():
        pkg = package(func, root) or "other"
        for kind, key in (("package", pkg), ("function", f"{pkg}: {func[2]}")):
            out[kind][key] = out[kind].get(key, 0.0) + sec * scale
    return out


def markdown(plain: dict[str, dict[str, float]], managed: dict[str, dict[str, float]], top: int,
             shared: tuple[str, ...] = ("torch", "diffusers")) -> list[str]:
    """Two :func:`by_owner` results side by side: a per-package table (ms), then the ``top`` functions
    with the largest excess of ``managed`` over ``plain``, leaving out the ``shared`` packages (the same
    tensor work on both sides, where differences are noise)."""
    lines = ["| package | plain ms/step | managed ms/step | managed - plain |", "|---|---|---|---|"]
    for kind in ("package", "function"):
        a, b = plain[kind], managed[kind]
        keys = sorted(set(a) | set(b), key=lambda k: a.get(k, 0.0) - b.get(k, 0.0))
        if kind == "package":
            lines += [f"| {k} | {a.get(k, 0.0):.2f} | {b.get(k, 0.0):.2f} | {b.get(k, 0.0) - a.get(k, 0.0):+.2f} |"
                      for k in keys if max(a.get(k, 0.0), b.get(k, 0.0)) >= 0.01]
        else:
            picked = [k for k in keys if not k.startswith(tuple(f"{s}:" for s in shared))][:top]
            lines += ["", f"Top functions outside {', '.join(shared)}, managed - plain (ms/step under cProfile): "
                      + "; ".join(f"`{k}` {b.get(k, 0.0) - a.get(k, 0.0):+.2f}" for k in picked) + "."]
    return lines
