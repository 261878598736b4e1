"""Optimizers of the trainer: `optimizer.build_optimizer` picks AdamW or Muon + AdamW; Muon's math
is in `muon.py`, its communication plans in `muon_plan.py` (pure) and `muon_comm.py` (execution)."""
