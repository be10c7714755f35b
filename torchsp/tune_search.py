"""End-to-end greedy search of the autotuner (TorchSparse++'s group-based tuning).

torchsp.tune first times every candidate of each layer signature alone (warm caches, no
neighbours).  Inside a network the ranking can change: what the previous layer left in L2,
the host sync of a plan that lists pairs, launch gaps between small kernels.  On the H100
(2026-11-23) per-layer choices measured up to 25% slower end to end than the best single
dataflow.  So tune() then refines the choices against the time of the whole model:

  1. start from the best of: the per-layer choices, and each single dataflow given to every
     unit where it is eligible, every dataflow eligible in some unit, tried in order of the
     model time their per-layer times predict (so the result is never worse than the best fixed
     dataflow that was measured, and a short budget measures the likeliest first);
  2. visit units in decreasing order of their per-layer time and try each unit's other
     promising candidates (per-layer time within `spread` of the unit's best), keeping a
     change only when the whole model gets faster by more than `tol`;
  3. stop when `budget_s` is spent;
  4. re-measure the finalists (the search's result, the per-layer choices, the default and
     the best single dataflow) in interleaved rounds and keep the fastest, the default when
     it is within `margin`: the search's own minimum is biased low by its many noisy trials
     (H100, 2026-11-23: whole-model timings of one configuration vary by several percent).

A *unit* is (signature, pass).  Forward units are searched against the forward; dgrad units
(training) against the training step with the forward choices fixed: forward and dgrad are
bound in that order, so the search stays linear in the number of choices.
"""

import time


def greedy(objective, current, ranked, budget_s=20.0, tol=0.01, spread=1.25, clock=time.perf_counter,
           log=None, always=()):
    """Refine `current` against `objective`; returns (best config, its seconds, trials).

    trials: (what, seconds, kept, config) per objective call, the starting point first.

    Args:
        objective: config -> seconds (lower is better); config maps unit -> algo (a list).
        current: {unit: algo}, the per-layer choices (every unit to search).
        ranked: {unit: [(seconds, algo), ...]} eligible candidates with their per-layer
            times, fastest first; a unit without entries keeps its choice.
        budget_s: wall seconds after which no new trial starts.
        tol: a change is kept when it is faster than the best so far by this fraction.
        spread: in the unit-by-unit phase, candidates slower than spread x the unit's fastest
            per-layer time are not tried (single dataflows are tried regardless).
        log: optional callable(str) for a progress line per trial.
        always: algos tried first as single dataflows (the default dataflow, so the summary can
            say what tuning saved over it).
    """
    t0 = clock()
    trials = []

    def promising(u):
        rs = ranked.get(u) or []
        if not rs:
            return []
        fastest = rs[0][0]
        return [list(a) for t, a in rs if t <= fastest * spread]

    best = {u: list(a) for u, a in current.items()}
    best_t = objective(best)
    trials.append(("per-layer choices", best_t, True, best))

    # 1. Single dataflows for every unit where eligible: `always` first, then every algo some unit
    #    ranks, by the sum of per-layer times it predicts (a unit where it is not eligible counts
    #    its current choice).
    unit_times = {u: {str(list(b)): t for t, b in ranked.get(u) or []} for u in current}

    def predicted(a):
        return sum(unit_times[u].get(str(a), unit_times[u].get(str(list(cur)), 0.0)) for u, cur in current.items())

    singles = [list(a) for a in always]
    others = []
    for u in current:
        for _, a in ranked.get(u) or []:
            if list(a) not in singles and list(a) not in others:
                others.append(list(a))
    singles += sorted(others, key=predicted)
    for a in singles:
        cfg = {u: (list(a) if any(list(b) == a for _, b in ranked.get(u) or []) else list(best_u))
               for u, best_u in best.items()}
        if cfg == best or clock() - t0 > budget_s:
            continue
        t = objective(cfg)
        keep = t < best_t
        trials.append((f"single {a}", t, keep, cfg))
        if log:
            log(f"single {a}: {t * 1e3:.2f} ms{' (best)' if keep else ''}")
        if keep:
            best, best_t = cfg, t

    # 2. Unit by unit, heaviest first.
    weight = {u: (ranked.get(u) or [(0.0, None)])[0][0] for u in current}
    for u in sorted(current, key=lambda u: -weight[u]):
        for a in promising(u):
            if a == best[u]:
                continue
            if clock() - t0 > budget_s:
                trials.append(("budget spent", best_t, False, best))
                return best, best_t, trials
            cfg = dict(best)
            cfg[u] = a
            t = objective(cfg)
            keep = t < best_t * (1.0 - tol)
            trials.append((f"{u} -> {a}", t, keep, cfg))
            if log:
                log(f"{u[0]} {u[1]} {a}: {t * 1e3:.2f} ms{' (kept)' if keep else ''}")
            if keep:
                best, best_t = cfg, t
    return best, best_t, trials


def confirm(measure_once, finalists, rounds=5, prefer=None, margin=0.01):
    """Interleaved re-measurement of a few configurations; returns (winner name, {name: median s}).

    Args:
        measure_once: config -> seconds of one call (the caller warms up inside).
        finalists: {name: config}; equal configurations are measured once.
        rounds: each round measures every distinct configuration once.
        prefer: a finalist kept when within `margin` of the fastest (the default dataflow).
    """
    distinct = {}
    for name, cfg in finalists.items():
        if not any(cfg == other for other in distinct.values()):
            distinct[name] = cfg
    times = {name: [] for name in distinct}
    for _ in range(max(1, rounds)):
        for name, cfg in distinct.items():
            times[name].append(measure_once(cfg))
    med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
    win = min(med, key=med.get)
    if prefer is not None:
        same = next((n for n, c in distinct.items() if c == finalists.get(prefer)), None)
        if same is not None and med[same] <= med[win] * (1.0 + margin):
            win = same
    return win, med


def passes_that_win(medians, train, margin=0.01):
    """The passes whose searched units beat the all-default configuration as the model is used.

    Args:
        medians: {"tuned": (forward s, step s), "default": (forward s, step s)}.
        train: whether training steps were measured (else only "fwd" can win).
        margin: a pass wins when tuned is faster than default by more than this fraction.
    Returns:
        ["fwd"], ["dgrad"], both or none: forward units are judged by the forward, dgrad
        units by the training step.
    """
    out = []
    for i, p in enumerate(("fwd", "dgrad") if train else ("fwd",)):
        if medians["tuned"][i] < medians["default"][i] * (1.0 - margin):
            out.append(p)
    return out
