"""Data and prompts: problem and trace files, generated arithmetic, problem sets, prompt templates, teacher traces."""
