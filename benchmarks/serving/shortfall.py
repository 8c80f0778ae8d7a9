"""Where the best served drafter stands against what it needs: a record on SPEEDUP.md read from records already
there, measuring nothing. It names the best recipe row (seed and launch noise inside its interval) and the
break-even of its draft shape from the same launch, splits that shape's cycle as CYCLE_COST.md measured it, and
reads the served-accepted-length curve over training data for what closing the gap would take.

    python -m benchmarks.serving.shortfall
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from dataclasses import dataclass

from benchmarks.common.records import Page, Provenance, Record, Table, page_argument
from harness.serving.break_even import interval_text
from harness.serving.metrics import SPEEDUP  # the key speedup.py records each row's speed-up under
from harness.uncertainty import Estimate, mean_estimate

GROUP, PAGE, CYCLE_PAGE = "serving", "SPEEDUP", "CYCLE_COST"
TARGET = "f32"  # the target the verdict is about (the agreement check's)
CURVE_COLUMNS = ("run", "block", "conversations (supervised tokens)", "served accepted length")


@dataclass(frozen=True)
class BreakEven:
    block: int
    vocabulary: int | None
    value: float
    low: float  # nan with one prompt
    high: float  # inf where the lower bounds never cross 1
    cycle_cost: float  # plain target tokens per cycle at accepted length 1


@dataclass(frozen=True)
class RecipeRow:
    label: str
    speedup: tuple[float, float, float]  # value, low, high
    accepted_length: float
    shape: tuple[int, int | None, float]  # block, draft vocabulary, confidence cut
    trained_block: int | None  # the block its drafts were trained at (an n-max cut serves fewer); None: not recorded
    layers: int | None  # its drafts' decoder layers; None: not recorded (then its break-even's are not either)
    seed_speedups: tuple[float, ...] = ()  # each seed's mean over its rounds; empty: not recorded
    seed_accepted: tuple[float | None, ...] = ()  # each seed's accepted length; empty: not recorded

    def own_cycle(self) -> tuple[Estimate, bool] | None:
        """What one cycle of these drafts cost in plain tokens, per seed accepted length / speed-up, with a t
        interval over seeds (launch noise inside each seed's mean over rounds), and whether each seed's own
        accepted length was recorded (else the row's pooled one stands in for each). A cycle's cost barely depends
        on how many of its tokens are accepted, so this is the accepted length at which these drafts break even."""
        if len(self.seed_speedups) < 2:
            return None
        per_seed = len(self.seed_accepted) == len(self.seed_speedups) and None not in self.seed_accepted
        accepted = self.seed_accepted if per_seed else (self.accepted_length,) * len(self.seed_speedups)
        return mean_estimate([a / s for a, s in zip(accepted, self.seed_speedups, strict=True)]), per_seed

    @property
    def runs(self) -> str:
        """The runs the row pools, as its label names them (`**recipe** `a`, `b``), before the variant."""
        return self.label.split(" (", 1)[0]


@dataclass(frozen=True)
class BestRecipe:
    best: RecipeRow
    # The row the break-even is about: the best one, or with a confidence cut (p-min) the same drafts uncut in the
    # same launch, since a cut cycle drafts fewer tokens or none and no synthetic break-even is its own
    uncut: RecipeRow
    break_even: BreakEven
    record_title: str
    machine: str | None  # where the record was measured; None: not recorded
    ladder: dict | None = None  # the uncut shape's accepted length over training conversations in the same launch


def recipe_ladder(uncut: RecipeRow, rows: list[RecipeRow], runs: dict[str, dict]) -> dict | None:
    """The best recipe's own curve: the uncut rows of its shape in the same launch whose runs were trained on other
    numbers of conversations, the fewest's and the most's accepted lengths, with each one's steps (`runs`: the
    record's trained values by run name). None where the launch served one size."""
    by_count: dict[int, tuple[float, int]] = {}
    for row in rows:
        if row.shape != uncut.shape or row.layers != uncut.layers:
            continue
        trained = [runs.get(name, {}) for name in re.findall(r"`([^`]+)`", row.runs)]
        counts = {t.get("conversations") for t in trained}
        if len(counts) == 1 and None not in counts:
            by_count[counts.pop()] = (row.accepted_length, trained[0].get("steps"))
    if len(by_count) < 2:
        return None
    fewest, most = min(by_count), max(by_count)
    (low, low_steps), (high, high_steps) = by_count[fewest], by_count[most]
    per_fourfold = (high - low) / math.log(most / fewest, 4)
    return {
        "fewest": fewest,
        "most": most,
        "low": low,
        "high": high,
        "steps": [low_steps, high_steps],
        "per_fourfold": per_fourfold,
    }


def best_recipe(records: list[Record], target: str = TARGET) -> BestRecipe:
    """The recipe row with the highest speed-up on `target` in the latest record that has labelled recipe rows,
    with the break-even of its shape measured in the same launch."""
    for record in reversed(records):
        found = record.values.get(target, {})
        recipes = [recipe for recipe in found.get("recipes", []) if "label" in recipe]
        if not recipes:  # none, or written before speedup.py recorded each row's shape
            continue
        rows = [
            RecipeRow(
                r["label"],
                tuple(r[SPEEDUP]),
                r["accepted_length"],
                recipe_shape(r),
                r.get("trained_block"),
                r.get("layers"),
                tuple(r.get("seed_means", ())),
                tuple(r.get("seed_accepted", ())),
            )
            for r in recipes
        ]
        best = max(rows, key=lambda row: row.speedup[0])
        (uncut,) = [row for row in rows if row.runs == best.runs and row.shape == best.shape[:2] + (0.0,)]
        block, vocabulary, _ = best.shape
        (line,) = [
            b
            for b in found["break_even"]
            if (b["block"], b.get("layers"), b["vocabulary"]) == (block, best.layers, vocabulary)
        ]
        break_even = BreakEven(block, vocabulary, *line["accepted_length"], line["cycle_cost"])
        ladder = recipe_ladder(uncut, rows, record.values.get("runs", {}))
        return BestRecipe(best, uncut, break_even, record.title, record.machine, ladder)
    raise SystemExit(f"no record of benchmarks/{GROUP}/{PAGE}.md has labelled recipe rows on the {target} target")


def recipe_shape(recipe: dict) -> tuple[int, int | None, float]:
    """A recipe row's draft shape: block, draft vocabulary (None: the whole one) and confidence cut."""
    return recipe["block"], recipe["vocabulary"], recipe["confidence_cut"]


def cycle_split(records: list[Record], block: int, trained_block: int | None = None, target: str = TARGET) -> dict:
    """The latest measured split of a block's cycle on `target`, in plain target tokens. A draft of
    `trained_block` cut to `block - 1` tokens by --n-max is split from its own cut cycle where the cycle-cost
    benchmark timed one (its verify batch is the batch of `block` positions); failing that, a shape it did not
    split gets its verify batch alone, and its draft side and whole cycle are None (not measured as such)."""
    for record in reversed(records):
        found = record.values.get(target, {})
        plain = found.get("plain_ms")
        cut = f"block{trained_block}_n_max{block - 1}"
        if f"block{block}" in found:
            cycle_ms, verify_ms = found[f"block{block}"]["cycle_ms"], found[f"block{block}"]["verify_ms"]
        elif cut in found:
            cycle_ms, verify_ms = found[cut], found["batch_ms"][str(block)]
        elif str(block) in found.get("batch_ms", {}):
            cycle_ms, verify_ms = None, found["batch_ms"][str(block)]
        else:
            continue
        return {
            "plain_ms": plain,
            "verify": verify_ms / plain,
            "draft_side": None if cycle_ms is None else (cycle_ms - verify_ms) / plain,
            "cycle": None if cycle_ms is None else cycle_ms / plain,
            "record": record.title,
            "machine": record.machine,
        }
    raise SystemExit(f"no record of benchmarks/{GROUP}/{CYCLE_PAGE}.md measures a block-{block} cycle on {target}")


def own_text(uncut: RecipeRow, own: tuple[Estimate, bool] | None) -> str:
    """The uncut drafts' break-even read from their own served cycles (`uncut.own_cycle()`), beside the synthetic
    one."""
    if own is None:
        return ""
    cycle, per_seed = own
    accepted = (
        "each seed's accepted length"
        if per_seed
        else "the row's pooled accepted length (the record holds no per-seed one)"
    )
    short = cycle.value - uncut.accepted_length
    return (
        f" **Their own break-even**: a cycle of these drafts cost {cycle.text()} plain tokens, {accepted} over its "
        "speed-up, with a t interval over seeds and each seed's launch noise inside its mean over rounds. A cycle "
        "costs about the same however many of its tokens are accepted (the block decode and the verify batch keep "
        "their size), so that is the accepted length they needed: "
        + (f"**{short:.2f} more** than they reached." if short > 0 else f"they reached it, {-short:.2f} above.")
    )


def ladder_text(ladder: dict, gap: float, own_gap: float | None) -> str:
    """What the best recipe's own curve says the gap would take: from its drafts' own break-even where the record
    has one, else from the synthetic one."""
    low_steps, high_steps = ladder["steps"]
    with_steps = f", steps rising with them ({low_steps} to {high_steps})" if low_steps != high_steps else ""
    head = (
        "**What the curve says** (an extrapolation from two points, not measured): the recipe's uncut drafts served "
        f"{ladder['low']:.2f} accepted tokens per cycle trained on {ladder['fewest']} conversations and "
        f"{ladder['high']:.2f} on {ladder['most']}, in the same launch{with_steps}: {ladder['per_fourfold']:+.3f} per "
        "fourfold conversations."
    )
    to_close, against = (own_gap, "their own") if own_gap is not None else (gap, "the synthetic")
    if to_close <= 0:
        return f"{head} The drafts reach {against} break-even: no more data is needed by this measure."
    if ladder["per_fourfold"] <= 0:
        return f"{head} It gives no rate to extrapolate."
    fourfolds = to_close / ladder["per_fourfold"]
    return (
        f"{head} At that rate the gap of {to_close:.2f} to {against} break-even takes {fourfolds:.1f} more fourfold "
        f"steps, about {ladder['most'] * 4**fourfolds:,.0f} conversations: more data of this kind alone does not "
        "close it within this CPU's budget; the cycle's cost has to fall, or the acceptance per conversation rise."
    )


def tokens_text(value: float | None) -> str:
    return "not measured for this shape" if value is None else f"{value:.2f}"


def curve_rate(records: list[Record], block: int) -> dict | None:
    """Served accepted length per fourfold training conversations at `block`, from the latest curve record: the
    runs at the fewest and the most conversations (their trunks, not WSD branches), each count's mean."""
    for record in reversed(records):
        for table in (b for b in record.blocks if isinstance(b, Table)):
            if not all(column in table.columns for column in CURVE_COLUMNS):
                continue
            at = {column: table.columns.index(column) for column in CURVE_COLUMNS}
            by_count: dict[int, list[float]] = {}
            for row in table.rows:
                if "(branch of" in row[at["run"]] or int(row[at["block"]]) != block:
                    continue
                count = int(row[at["conversations (supervised tokens)"]].split()[0])
                by_count.setdefault(count, []).append(float(row[at["served accepted length"]]))
            if len(by_count) < 2:
                continue
            fewest, most = min(by_count), max(by_count)
            low, high = statistics.fmean(by_count[fewest]), statistics.fmean(by_count[most])
            fourfolds = math.log(most / fewest, 4)
            return {"fewest": fewest, "most": most, "low": low, "high": high, "per_fourfold": (high - low) / fourfolds}
    return None


def shortfall_record(speedup_records: list[Record], cycle_records: list[Record], command: str | None = None) -> Record:
    found = best_recipe(speedup_records)
    best, uncut, shape = found.best, found.uncut, found.break_even
    split = cycle_split(cycle_records, shape.block, best.trained_block)
    curve_block = shape.block
    curve = curve_rate(speedup_records, curve_block)
    if curve is None and best.trained_block not in (None, shape.block):  # an n-max cut of a trained block
        curve_block = best.trained_block
        curve = curve_rate(speedup_records, curve_block)
    of_block = (
        ""
        if curve_block == shape.block
        else f" at the drafts' trained block {curve_block} (no curve at block {shape.block}: a draft cut to fewer "
        "tokens may gain less per conversation)"
    )
    gap = shape.value - uncut.accepted_length
    own = uncut.own_cycle()
    value, low, high = best.speedup
    against = (
        ""
        if uncut is best
        else (
            "A cut cycle drafts fewer tokens or none, so no synthetic break-even is its own; the same drafts uncut "
            f"in the same launch served {uncut.speedup[0]:.3f} [{uncut.speedup[1]:.3f}, {uncut.speedup[2]:.3f}] at "
            f"{uncut.accepted_length:.2f} accepted tokens per cycle. "
        )
    )
    blocks = [
        f"Read from the records above and from `{CYCLE_PAGE}.md`; nothing new was measured. **Best reached** on the "
        f"{TARGET} target: {best.label} (record {found.record_title}), speed-up {value:.3f} [{low:.3f}, {high:.3f}], "
        f"{'above' if low > 1 else 'not above'} 1, at {best.accepted_length:.2f} accepted tokens per drafting "
        f"cycle. {against}**Break-even** of the uncut shape in the same launch (block {shape.block}"
        f"{f', {shape.vocabulary}-token draft vocabulary' if shape.vocabulary else ''}): "
        f"{interval_text(shape.value, shape.low, shape.high)}, a cycle costing {shape.cycle_cost:.2f} plain tokens. "
        "The uncut drafts "
        f"need **{gap:.2f} more accepted tokens per cycle** to break even." + own_text(uncut, own),
        Table(
            [f"part of a block-{shape.block} cycle (`{split['record']}`, accepted length 1)", "plain tokens"],
            [
                ["the verify batch (the target on the block's positions)", f"{split['verify']:.2f}"],
                [
                    "the draft side (K/V injection, block decode, vocabulary head, host work)",
                    tokens_text(split["draft_side"]),
                ],
                ["the whole cycle (whole-vocabulary head)", tokens_text(split["cycle"])],
            ],
        ),
        f"The verify batch alone costs {split['verify']:.2f} plain tokens ({split['plain_ms']:.1f} ms a plain "
        f"token): a draft whose side cost nothing would still need {split['verify']:.2f} accepted tokens per cycle."
        + (
            f" The split was measured on {split['machine']}, the served launch on {found.machine}: each part is "
            "in that machine's plain tokens, not this launch's."
            if split["machine"] != found.machine
            else ""
        ),
    ]
    values = {
        "best": {"label": best.label, SPEEDUP: list(best.speedup), "accepted_length": best.accepted_length},
        "uncut": {"label": uncut.label, SPEEDUP: list(uncut.speedup), "accepted_length": uncut.accepted_length},
        "break_even": [shape.value, shape.low, shape.high],
        "cycle_cost": shape.cycle_cost,
        "gap": gap,
        "split": {k: v for k, v in split.items() if k not in ("record", "machine")},
    }
    if own is not None:
        values["own_break_even"] = [own[0].value, own[0].low, own[0].high]
        values["own_gap"] = own[0].value - uncut.accepted_length
    if found.ladder is not None:
        blocks.append(ladder_text(found.ladder, gap, values.get("own_gap")))
        values["curve"] = found.ladder | {"block": shape.block, "source": "recipe"}
    elif curve and curve["per_fourfold"] > 0:
        fourfolds = gap / curve["per_fourfold"]
        conversations = curve["most"] * 4**fourfolds
        blocks.append(
            f"**What the curve says** (an extrapolation from two points, not measured): served accepted length rose "
            f"{curve['per_fourfold']:+.3f} per fourfold training conversations{of_block}, {curve['low']:.2f} at "
            f"{curve['fewest']} and {curve['high']:.2f} at {curve['most']} (the latest curve record, chit-chat data "
            f"and its own prompts). At that rate the gap of {gap:.2f} takes {fourfolds:.1f} more fourfold steps, about "
            f"{conversations:,.0f} conversations: more data of one kind alone does not close it within this CPU's "
            "budget; the cycle's cost has to fall, or the acceptance per conversation rise."
        )
        values["curve"] = curve | {"fourfolds_needed": fourfolds, "block": curve_block}
    elif curve:
        blocks.append(
            f"**What the curve says**: served accepted length did not rise with data{of_block} ({curve['low']:.2f} at "
            f"{curve['fewest']} conversations, {curve['high']:.2f} at {curve['most']}), so it gives no rate to "
            "extrapolate."
        )
        values["curve"] = curve | {"block": curve_block}
    else:
        blocks.append(f"**What the curve says**: no curve record at block {shape.block} on this page.")
    return Record("Where the best drafter falls short", blocks, values, Provenance.now(command, derived=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    page_argument(parser, GROUP, PAGE)
    args = parser.parse_args(argv)
    page = Page.named(GROUP, args.page or PAGE)
    page.publish(shortfall_record(page.records(), Page.named(GROUP, CYCLE_PAGE).records()))


if __name__ == "__main__":
    main()
