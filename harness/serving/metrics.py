"""The served metrics' names, spelled here and nowhere else.

A run's served metrics are logged to MLflow under `PREFIX`; a study's served objective names one of them; a report
shows them as its `served_*` columns. Everything outside `harness/serving/` imports these names.
"""

from __future__ import annotations

PREFIX = "served/llama_cpp/"  # the run's draft served by llama.cpp, beside the harness's own numbers

# Per set and temperature tag the comparison also logs `<set>_accepted_length_<tag>` and counts (compare.py).
ACCEPTED_GREEDY = "accepted_length_greedy"  # served tokens per verify cycle at T = 0, the verified one included
AGREEMENT_CYCLES = "agreement_cycle_fraction"  # compared cycles in which llama.cpp accepted what the harness did
AGREEMENT_REQUESTS = "agreement_request_fraction"
CYCLES_COMPARED = "cycles_compared"
FLIPS_VS_ENGINE = "lossless_flips_vs_engine"  # requests whose served tokens differ from the engine alone
FLIPS_VS_HARNESS = "lossless_flips_vs_harness"  # ... from the harness's greedy reference
TOKENS_PER_S_DRAFT = "tokens_per_s_draft"
TOKENS_PER_S_ALONE = "tokens_per_s_alone"
SPEEDUP = "speedup"  # tokens/s with the draft over the bracketed target alone, paired by request
BREAK_EVEN = "break_even_accepted_length"  # the accepted length at which the draft's shape pays for itself
BREAK_EVEN_SHORTFALL = "break_even_shortfall"  # break-even minus the served accepted length
CYCLE_COST = "cycle_cost_plain_tokens"  # one draft-and-verify cycle's time in plain decoded tokens
ROUNDS = "speed_rounds"  # fresh launches (drafted and alone) the speed-up is the mean over; 1 for a compared serving
LAUNCH_VARIANCE = "speedup_launch_variance"  # the round speed-ups' sample variance: launch-to-launch noise
VOCABULARY = "draft_vocabulary"  # the tokens a speed-only serving's draft proposes from: all, or its reduced head's
CONFIDENCE_CUT = "draft_confidence_cut"  # a speed-only serving's --spec-draft-p-min (0: every cycle drafts its block)
DRAFT_LENGTH = "draft_length"  # the tokens a speed-only serving drafts per cycle at most (--spec-draft-n-max)


# llama.cpp's training-free speculation, served beside a run's draft on the same prompts (compare.py, benchmarks).
NGRAM_TYPES = ("ngram-mod", "ngram-map-k", "ngram-cache", "ngram-simple")


def ngram_speedup(kind: str) -> str:
    """`ngram_mod_speedup`: an n-gram type's speed-up over the same bracketed alone passes as the draft's."""
    return f"{kind.replace('-', '_')}_{SPEEDUP}"


def se(name: str) -> str:
    return f"{name}_se"


def low(name: str) -> str:
    return f"{name}_low"


def high(name: str) -> str:
    return f"{name}_high"


def synthetic(length: float, what: str) -> str:
    """A break-even point's metric: `synthetic_<length>_<what>` at a synthetic accepted length (2.5 -> 2_5)."""
    return f"synthetic_{f'{length:g}'.replace('.', '_')}_{what}"


# What `evaluate --engine llama.cpp` prints, in this order.
SUMMARY = (
    ACCEPTED_GREEDY,
    AGREEMENT_CYCLES,
    AGREEMENT_REQUESTS,
    FLIPS_VS_ENGINE,
    FLIPS_VS_HARNESS,
    TOKENS_PER_S_DRAFT,
    TOKENS_PER_S_ALONE,
    SPEEDUP,
    low(SPEEDUP),
    high(SPEEDUP),
    BREAK_EVEN,
    low(BREAK_EVEN),
    high(BREAK_EVEN),
    BREAK_EVEN_SHORTFALL,
    CYCLE_COST,
    *(ngram_speedup(kind) for kind in NGRAM_TYPES),
)

# A study's served objectives: each trial's run served at the end of its training (speed.py), read as this metric.
OBJECTIVE_SPEEDUP, OBJECTIVE_TOKENS_PER_S = "served_speedup", "served_tokens_per_s"
OBJECTIVE_ACCEPTED = "served_accepted_length"
OBJECTIVES = {
    OBJECTIVE_SPEEDUP: SPEEDUP,
    OBJECTIVE_TOKENS_PER_S: TOKENS_PER_S_DRAFT,
    OBJECTIVE_ACCEPTED: ACCEPTED_GREEDY,
}
# The served objectives a designed study can fit effects on, run by run (reports.analysis): each has a standard error.
RESPONSES = (OBJECTIVE_SPEEDUP, OBJECTIVE_ACCEPTED)

# A report's columns of a served run, and the served metric each one reads.
GREEDY_COLUMN = "served_greedy"
ROUNDS_COLUMN, LAUNCH_VARIANCE_COLUMN = "served_rounds", "served_launch_variance"
AGREEMENT_COLUMN = "served_agreement"
CYCLES_COLUMN = "served_cycles"
FLIPS_COLUMN, FLIPS_HARNESS_COLUMN = "served_flips", "served_flips_harness"
BREAK_EVEN_COLUMN = "served_break_even"
NGRAM_COLUMNS = {f"served_{ngram_speedup(kind)}": ngram_speedup(kind) for kind in NGRAM_TYPES}
COLUMNS = {
    GREEDY_COLUMN: ACCEPTED_GREEDY,
    ROUNDS_COLUMN: ROUNDS,
    LAUNCH_VARIANCE_COLUMN: LAUNCH_VARIANCE,
    AGREEMENT_COLUMN: AGREEMENT_CYCLES,
    CYCLES_COLUMN: CYCLES_COMPARED,
    FLIPS_COLUMN: FLIPS_VS_ENGINE,
    FLIPS_HARNESS_COLUMN: FLIPS_VS_HARNESS,
    **OBJECTIVES,  # a served objective is its own column
    # the speed-up's interval over requests (runs served before it was measured have none)
    se(OBJECTIVE_SPEEDUP): se(SPEEDUP),
    low(OBJECTIVE_SPEEDUP): low(SPEEDUP),
    high(OBJECTIVE_SPEEDUP): high(SPEEDUP),
    BREAK_EVEN_COLUMN: BREAK_EVEN,
    low(BREAK_EVEN_COLUMN): low(BREAK_EVEN),
    high(BREAK_EVEN_COLUMN): high(BREAK_EVEN),
    **NGRAM_COLUMNS,
}

# Every name above: none of them is spelled as a literal outside this package (tests/test_serving_package.py).
NAMES = (
    PREFIX,
    *SUMMARY,
    ROUNDS,
    LAUNCH_VARIANCE,
    VOCABULARY,
    CONFIDENCE_CUT,
    DRAFT_LENGTH,
    *OBJECTIVES,
    *(column for column in COLUMNS if column not in OBJECTIVES),
)
