"""Data and prompts: problem and trace files, generated arithmetic, problem sets, prompt templates, SFT trace sets."""
