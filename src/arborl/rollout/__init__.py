"""Rollout controllers: dispatch episodes, consume finished samples, drive the trainer."""
