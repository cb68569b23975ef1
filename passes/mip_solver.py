"""Running the partition MIP's solver: HiGHS (through highspy, quietly, with a cutoff and no
MIP start) or CBC (with the warm start, its bound read from its log). The MIP it
solves is built by passes/_partition_mip.py.

    run_solver(mip, "highs", 5.0, 1e-4, False, None)    # (status, objective, bound)
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import pulp

__all__ = ["run_solver", "solve_relaxation"]


@cache
def _quiet_highs() -> type:
    """A highspy.Highs that never prints, not even the once-per-process banner.

    HiGHS writes "Running HiGHS ... Copyright" on the first logging call of an instance whose
    `output_flag` is still on, and highspy's constructor makes such a call (it registers its
    callbacks) before PuLP can set `output_flag=False`. So turn the flag off first, inside
    that registration. (Defined lazily: highspy is an optional dependency.)
    """
    import highspy

    class QuietHighs(highspy.Highs):
        def enableCallbacks(self):
            self.setOptionValue("output_flag", False)
            super().enableCallbacks()

    return QuietHighs


class _QuietHiGHS(pulp.HiGHS):
    """PuLP's highspy interface, silent, and deliberately without a MIP start.

    HiGHS (seen in 1.16) mis-values a user MIP start once presolve's aggregator has substituted
    columns: the start is reported "feasible in the reduced space" with an objective below its
    real value, becomes an incumbent no node can beat, and the solve ends "optimal" at once
    with the start's columns and that wrong value as primal and dual bound. A warm start from
    a worse cut set was then "proven" optimal (tests/unit/test_partition.py::
    test_a_warm_start_is_never_proven_optimal_when_a_better_cut_exists). What the start gave
    is kept without it: its makespan reaches HiGHS as `objective_bound` (the cutoff) and its
    cut set stays the candidate's incumbent in `solve`.
    """

    def __init__(self, *args, **kw):
        super().__init__(*args, msg=False, **kw)

    def createAndConfigureSolver(self, lp):
        # PuLP's version builds a plain highspy.Highs (which prints the banner); we set the
        # same options, which are all that `run_solver` passes.
        lp.solverModel = _quiet_highs()()
        opts = {"output_flag": False, "mip_rel_gap": self.gapRel,
                "time_limit": None if self.timeLimit is None else float(self.timeLimit), **self.optionsDict}
        for key, value in opts.items():
            if value is not None:
                lp.solverModel.setOptionValue(key, value)


def run_solver(mip: Any, solver: str, time_limit: float, gap_rel: float, warm: bool,
                cutoff: float | None) -> tuple[str, float, float]:
    """Solve; return (status, objective, best bound), both in objective units (inf if none).

    `warm`: start CBC from the variables' initial values (`warm_start`); HiGHS never gets a start.
    `cutoff`: only objectives below it are searched (HiGHS; CBC ignores it).
    """
    lp = mip.lp
    if solver == "highs":
        import highspy
        opts = {"mip_feasibility_tolerance": 1e-7}
        if cutoff is not None:
            opts["objective_bound"] = cutoff
        cmd = _QuietHiGHS(timeLimit=max(time_limit, 0.05), gapRel=gap_rel, **opts)  # no MIP start: see there
        lp.solve(cmd)
        h = lp.solverModel
        st, info = h.getModelStatus(), h.getInfo()
        K = highspy.HighsModelStatus
        has_sol = info.primal_solution_status == 2 and mip.T.value() is not None
        obj = mip.T.value() if has_sol else math.inf
        bound = info.mip_dual_bound if info.mip_dual_bound == info.mip_dual_bound else -math.inf
        if has_sol and abs(info.objective_function_value - obj) > 1e-7 * max(1.0, abs(obj)):
            # Its status and bounds are about another objective than its columns' (what the
            # mis-valued MIP start did): the columns are a plan, nothing is proven.
            return "unproven", obj, -math.inf
        # With a cutoff the search only covers objectives below it: whatever it proves is
        # "optimum >= min(bound, cutoff)", and finishing without beating it settles S.
        cut = cutoff if cutoff is not None else math.inf
        if st == K.kOptimal:
            if obj > cut * (1 + 1e-9):
                return "cut off", obj, cut
            # (a program without integer columns, e.g. S = 1, is an LP: HiGHS leaves its MIP
            # dual bound at 0, and its optimum is its own bound)
            return "optimal", obj, min(bound, obj) if lp.isMIP() else obj
        if st in (K.kInfeasible, K.kUnboundedOrInfeasible, K.kObjectiveBound):
            return ("cut off", obj, cut) if cutoff is not None else ("infeasible", math.inf, math.inf)
        # (Without a MIP start, running out of time before beating the cutoff leaves no
        # solution; the candidate's own plan is still there, so it is the time limit too.)
        timed_out = obj < math.inf or st == K.kTimeLimit
        return ("time limit" if timed_out else "no solution"), obj, min(bound, cut)
    with tempfile.TemporaryDirectory() as tmp:  # CBC: no cutoff; its bound is read from the log
        log = os.path.join(tmp, "cbc.log")
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC; it is still the
            warnings.simplefilter("ignore", DeprecationWarning)  # one CBC that is always there
            cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=round(max(time_limit, 0.2), 2), gapRel=gap_rel,
                                    warmStart=warm, logPath=log)
        lp.solve(cmd)
        text = Path(log).read_text() if os.path.exists(log) else ""
    result = re.search(r"^Result - (.*)$", text, re.M)
    result = result.group(1).lower() if result else ""
    if "infeasible" in result or pulp.LpStatus[lp.status] == "Infeasible":
        return "infeasible", math.inf, math.inf
    obj = pulp.value(lp.objective) if lp.sol_status in (1, 2) else math.inf
    if "optimal" in result:
        return "optimal", obj, obj * (1 - gap_rel)
    if not result and re.search(r"^Optimal - objective value", text, re.M):
        return "optimal", obj, obj  # no integer columns (S = 1): CBC solved an LP, no "Result" line
    found = re.findall(r"best possible ([-+0-9.eE]+)", text)
    bound = float(found[-1]) if found else -math.inf
    return ("time limit" if obj < math.inf else "no solution"), obj, min(bound, obj)


def solve_relaxation(mip: Any, solver: str, time_limit: float) -> tuple[str, float]:
    """The LP relaxation of `mip` (its integer columns made continuous, in place): ("bound",
    its optimum), ("infeasible", inf) or ("no bound", -inf) when time ran out; objective units.

    HiGHS runs its interior point method (with crossover): about twice as fast as its simplex
    on these programs. A relaxation's optimum is a lower bound of the program's.
    """
    lp = mip.lp
    frozen = [y for y, _ in mip.frozen.values()]
    for v in (*mip.z.values(), *mip.t.values(), *mip.tied.values(), *frozen):  # every integer column
        if isinstance(v, pulp.LpVariable):
            v.cat = pulp.LpContinuous
    if solver == "highs":
        import highspy
        lp.solve(_QuietHiGHS(timeLimit=max(time_limit, 0.05), solver="ipm"))
        st, K = lp.solverModel.getModelStatus(), highspy.HighsModelStatus
        if st == K.kOptimal:
            return "bound", lp.solverModel.getInfo().objective_function_value
        if st in (K.kInfeasible, K.kUnboundedOrInfeasible):
            return "infeasible", math.inf
        return "no bound", -math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=round(max(time_limit, 0.2), 2))
    lp.solve(cmd)
    status = pulp.LpStatus[lp.status]
    if status == "Optimal" and lp.sol_status == 1:
        return "bound", pulp.value(lp.objective)
    if status == "Infeasible":
        return "infeasible", math.inf
    return "no bound", -math.inf
