"""LoRA adapters over a frozen base, sharded like the base (`sharding.PLAN` holds their placements).

- `config.py`: rank, alpha, which target modules (`LoraTarget`: attention projections, experts).
- `merge.py`: the merge arithmetic, defined once: `W + (alpha / rank) * B @ A` in float32, the
  product summed over the rank in a fixed order, rounded once to the served dtype.
- `layers.py`: the LoRA forms of the attention projections and of the grouped experts.
- `adapters.py`: attach adapters to a stage, keep the merged target weights for refits, describe
  them to syncd (a partial catalog), save and reassemble the adapter's shards.
"""

from trainer_svc.lora.config import LoraConfig, LoraTarget
from trainer_svc.lora.merge import merge_lora

__all__ = ["LoraConfig", "LoraTarget", "merge_lora"]
