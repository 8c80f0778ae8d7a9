"""Servable checkpoints: Z Lab native tensors (bf16, exact names) plus one dual native/speculators config."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from algorithms import ALGORITHMS
from algorithms.dflash import DFlashDraft
from algorithms.registry import Algorithm, PeerFormat
from harness.files import atomic_write
from harness.layout import ARTIFACTS, STORES
from harness.run import EXPORT_DIR

SPECULATORS_VERSION = "0.9.0"


def qwen3_fields(draft: DFlashDraft) -> dict:
    """The draft decoder as a Qwen3 config (top level of config.json and `transformer_layer_config`)."""
    cfg, target = draft.config, draft.config.target
    return {
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rope_theta": target.rope_theta,
        "rope_parameters": {"rope_type": "default", **(target.rope_scaling or {}), "rope_theta": target.rope_theta},
        # transformers 4.x reads a scaling from `rope_scaling` alone
        **({"rope_scaling": target.rope_scaling} if target.rope_scaling else {}),
        "layer_types": ["sliding_attention"] * cfg.num_layers,
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": True,
        "max_window_layers": cfg.num_layers,
        "tie_word_embeddings": False,
        "is_causal": cfg.causal_blocks,
    }


class NoPeerFormat(ValueError):
    """The draft's algorithm has no checkpoint format any peer can load."""


def peer_format(entry: Algorithm) -> PeerFormat:
    if entry.export_format is None:
        loadable = [a.name for a in ALGORITHMS.values() if a.export_format is not None]
        raise NoPeerFormat(
            f"cannot export a {entry.name} draft: no peer format holds it "
            f"(Z Lab dflash, speculators and vLLM load only {loadable}); its checkpoint.pt stays usable here"
        )
    return entry.export_format


def checkpoint_config(draft: DFlashDraft, verifier_name_or_path: str) -> dict:
    """One config.json that Z Lab dflash, speculators and vLLM all read."""
    cfg, target, shared = draft.config, draft.config.target, draft.shared
    peer = peer_format(draft.algorithm.entry)
    transform = {}
    if target.output_multiplier != 1.0:
        transform["output_multiplier"] = target.output_multiplier
    if target.final_logit_softcapping:
        transform["final_logit_softcapping"] = target.final_logit_softcapping
    if target.input_embedding_scale != 1.0:
        transform["input_embedding_scale"] = target.input_embedding_scale
    selector = draft.export_fields()
    layer = qwen3_fields(draft)
    speculative_tokens = cfg.block_size - shared.first_draft_slot
    return {
        "architectures": [peer.architecture],
        **layer,
        "dtype": "bfloat16",
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {
            "block_size": cfg.block_size,
            "target_layer_ids": [i - 1 for i in cfg.target_layer_ids],
            "mask_token_id": cfg.mask_token_id,
            **({"causal": True} if cfg.causal_blocks else {}),  # how vLLM and Z Lab read in-block causal drafts
            **selector,
            **transform,
        },
        "speculators_model_type": peer.model_type,
        "speculators_version": SPECULATORS_VERSION,
        "aux_hidden_state_layer_ids": list(cfg.target_layer_ids),
        "draft_vocab_size": target.vocab_size,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": shared.sample_from_anchor,
        "sliding_window_non_causal": not cfg.causal_blocks,
        "target_hidden_size": None,
        **selector,
        **transform,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": peer.model_type,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(target.architectures)},
        },
    }


EXPORT_FILES = ("config.json", "model.safetensors")


class ExportDestinationError(ValueError):
    """An --out that an export must not replace."""


# What an export may never replace, relative to the work directory: stores, caches and run directories.
PROTECTED = ("runs", "features", "targets", "studies", ARTIFACTS, *STORES)


def replaces_protected(out: Path, workdir: Path) -> bool:
    """Whether replacing `out` would delete the work directory or anything of its stores, caches or runs.

    `<workdir>/runs/<run>/export`, the default destination, is the one place under `runs/` an export owns.
    """
    out, work = out.resolve(), workdir.resolve()
    if out == work or out in work.parents:
        return True
    for name in PROTECTED:
        protected = work / name
        if out == protected or out in protected.parents:
            return True
        if out.is_relative_to(protected):
            inside = out.relative_to(protected).parts
            return not (name == "runs" and len(inside) == 2 and inside[1] == EXPORT_DIR)
    return False


def check_destination(out_dir: Path, workdir: Path, force: bool) -> None:
    """Refuse an --out whose contents an export would destroy.

    A previous export (exactly the export files) is replaced; another non-empty directory needs `force`;
    the work directory's stores, caches and run directories are never replaced, `force` or not.
    """
    out = Path(out_dir)
    if replaces_protected(out, workdir):
        raise ExportDestinationError(
            f"invalid --out={str(out_dir)!r}: allowed a directory outside the work directory's stores, caches "
            f"and run directories, or <run>/{EXPORT_DIR} (the default)"
        )
    if out.exists() and not out.is_dir():
        raise ExportDestinationError(f"invalid --out={str(out_dir)!r}: allowed a directory, not a file")
    found = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if found and set(found) != set(EXPORT_FILES) and not force:
        raise ExportDestinationError(
            f"invalid --out={str(out_dir)!r}: allowed an empty directory or a previous export; it holds "
            f"{found[:5]}; pass --force to replace it"
        )


def export_checkpoint(draft: DFlashDraft, out_dir: Path, verifier_name_or_path: str) -> Path:
    """Write model.safetensors (bf16, no embed/head) and config.json into `out_dir`, atomically."""
    out_dir = Path(out_dir)
    config = checkpoint_config(draft, verifier_name_or_path)
    tensors = {
        name: value.detach().to(torch.bfloat16).cpu().contiguous() for name, value in draft.export_tensors().items()
    }

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        config_file, weights_file = EXPORT_FILES
        save_file(tensors, tmp / weights_file, metadata={"format": "pt"})
        (tmp / config_file).write_text(json.dumps(config, indent=2))

    atomic_write(out_dir, write)
    return out_dir


def load_exported_weights(draft: DFlashDraft, checkpoint_dir: Path) -> DFlashDraft:
    """Load an exported checkpoint's tensors back into a draft of the same shape: the export holds exactly the
    tensors the draft exports (an identity conv it writes included), and every one of its own is loaded."""
    state = load_file(Path(checkpoint_dir) / "model.safetensors")
    exported = set(draft.export_tensors())
    if set(state) != exported:
        raise ValueError(f"the export's tensors differ from the draft's: {sorted(set(state) ^ exported)[:5]}")
    own = draft.state_dict()
    draft.load_state_dict({k: v.float() for k, v in state.items() if k in own}, strict=True)
    return draft


def warm_start(draft: DFlashDraft, checkpoint_dir: Path) -> None:
    """Start `draft` from an export's weights (ours, or a released one in the same layout) once every tensor's name
    and shape match: a mismatch is refused in one line naming the first tensor that differs."""
    weights = Path(checkpoint_dir) / EXPORT_FILES[1]
    flag = f"invalid --init-from={str(checkpoint_dir)!r}"
    if not weights.is_file():
        raise FileNotFoundError(
            f"{flag}: no {EXPORT_FILES[1]} there; allowed an export directory (`dflash-lab export`, or a released "
            "draft in the Z Lab / speculators layout)"
        )
    state, own = load_file(weights), draft.state_dict()
    for name in sorted(set(own) | set(state)):
        if name not in state:
            problem = f"it has no tensor {name}"
        elif name not in own:
            problem = f"its tensor {name} has no place in this run's draft"
        elif state[name].shape != own[name].shape:
            problem = f"its {name} has shape {list(state[name].shape)}, this run's draft {list(own[name].shape)}"
        else:
            continue
        raise ValueError(f"{flag}: {problem}; allowed an export of a draft of this run's shape (block, layers, knobs)")
    draft.load_state_dict({name: value.float() for name, value in state.items()}, strict=True)
