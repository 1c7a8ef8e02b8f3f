"""The planner: which layouts an op runs in, priced under the link model.

    rows.py     what a rule says for ONE mesh dim (`Row`), a combination of one row per
                mesh dim (`Candidate`) and the order candidates rank in (`rank_key`)
    pricing.py  every time formula: collectives (ring model), moving an input, an op's own
                collectives, a pending output's later resolution, redundant work after a gather
    search.py   the best candidates without enumerating them (A* over mesh dims), and the
                exhaustive ranking it must equal
    choice.py   `candidates()`: search or enumerate, then the choice hooks (verify's forcing,
                tests' planner hook `choosing`); `with_plans` (the exact redistribution plans)

The package holds nothing of its own: import its modules. The registry of planning caches
and their one invalidation sit below it, in shardops/caches.py (spec.py and cost.py use it).
"""
