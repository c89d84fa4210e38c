"""Tasks from a tenant's own data: the `dataset` environment's room (env_svc/envs/dataset.py).

- `sources`: a file or folder in the tenant's data folder, read as records: JSONL line by line
  here, parquet, arrow and `save_to_disk` folders through Hugging Face `datasets`, in a child
  process with bounded memory and time (`workers`);
- `columns`: a column mapping from records to tasks (a prompt or a chat `messages` column, the
  reference answer, an optional system prompt);
- `answers`: how a reply is checked against the answer (exact, number, contains, `math-verify`,
  the last in worker processes whose main thread its `signal.alarm` time limits need:
  `mathcheck`).
"""
