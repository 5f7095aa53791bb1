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
folder where the run saved it (moved, pass ``model_config={"model_dir": NEW}`` to ``load_model``). This file
imports only mlflow and transformers: MLflow runs it to load the model, wherever the project is not installed.
"""

from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel


class HuggingFaceFolder(PythonModel):
    """``predict(prompts)``: each prompt's greedy completion, as text (at most ``max_new_tokens`` of the
    model config, default 256)."""

    def load_context(self, context: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = context.model_config["model_dir"]
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


mlflow.models.set_model(HuggingFaceFolder())
