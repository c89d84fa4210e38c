"""The embedded stack (`marlaas up`, `marlaas demo`): `local` (the stack: broker, Redis, S3,
the services, the API), `children` (supervised child processes), `s3server`, `topics`
(creation and outside lag reads) and `compose_gpus` (one compose service per GPU)."""
