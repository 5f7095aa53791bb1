"""An MLflow model of a policy saved as a Hugging Face folder, without a second copy of its weights.

The training flows save each trained policy as a Hugging Face folder (``output_dir/runs-<key>/<name>/model``)
and log this file as an MLflow pyfunc model ("models from code") whose ``model_config`` names that folder:
MLflow's registry, model pages and loaders work on it, and the weights stay where the run wrote them.
Load a registered version and generate::

    import mlflow
    policy = mlflow.pyfunc.load_model("models:/a5-grpo/latest")
    policy.predict(["What is 2 + 3?"])                      # one greedy completion a prompt
    mlflow.pyfunc.load_model("models:/a5-grpo/1", model_config={"max_new_tokens": 64})

or take the folder itself for any Hugging Face loader: ``policy.model_config["model_dir"]``. It needs the
folder where the run saved it (moved, pass ``model_config={"model_dir": NEW}`` to ``load_model``), holding the
files it held when the version was registered: their sha256 digests are part of the version
(``model_config["file_sha256"]``), and loading refuses a folder whose files changed since (a later run that wrote
to the same folder), rather than serve other weights under this version's name. This file imports only mlflow,
transformers and the standard library: MLflow runs it to load the model, wherever the project is not installed.
"""

import hashlib
from pathlib import Path
from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel


class HuggingFaceFolder(PythonModel):
    """``predict(prompts)``: each prompt's greedy completion, as text (at most ``max_new_tokens`` of the
    model config, default 256)."""

    def load_context(self, context: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = context.model_config["model_dir"]
        check_registered_files(Path(folder), context.model_config.get("file_sha256", {}))
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.max_new_tokens = int(context.model_config.get("max_new_tokens", 256))

    def predict(self, context: Any, model_input: list[str], params: dict[str, Any] | None = None) -> list[str]:
        import torch

        completions = []
        for prompt in model_input:
            ids = self.tokenizer(prompt, return_tensors="pt")
            with torch.no_grad():
                out = self.model.generate(
                    **ids,
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                )
            completions.append(self.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
        return completions


def check_registered_files(folder: Path, file_sha256: dict[str, str]) -> None:
    """ValueError naming the files of ``file_sha256`` (path relative to ``folder`` → sha256) that ``folder`` no
    longer holds with those bytes."""
    changed = []
    for name, digest in sorted(file_sha256.items()):
        path = folder / name
        if not path.is_file():
            changed.append(f"{name} (missing)")
            continue
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                changed.append(name)
    if changed:
        raise ValueError(
            f"model folder {folder}: {', '.join(changed)} changed since this model version was registered (a later "
            "run wrote to the same folder?); not loading other weights under its name"
        )


mlflow.models.set_model(HuggingFaceFolder())
