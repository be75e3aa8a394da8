"""The fifth method's own key: one TrainConfig key its row names (`train_keys_at`), composed into TrainConfig as every
method's are; EAGLE-3's keys, which its objective reads, come with EAGLE-3's row."""

from dataclasses import dataclass


@dataclass(kw_only=True)
class TrainKeys:
    twin_note: str = ""  # a note the twin's runs carry in their config
