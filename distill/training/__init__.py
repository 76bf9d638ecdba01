"""The training step: `DistillModule` (the LightningModule, which owns the step), what a
step minimizes (`objective`), the teachers that give its targets, the normalization
policies, the optimizer, and the Lightning callbacks around the step."""
