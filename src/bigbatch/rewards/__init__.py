"""Rewards for GRPO: ``--reward`` values parsed and loaded (:mod:`~bigbatch.rewards.functions`), the built-in
verifiable rewards (:mod:`~bigbatch.rewards.builtin`) and the toy task they check (:mod:`~bigbatch.rewards.demo_task`).

Importing it (and its functions, builtins and demo task) does not import torch."""

from __future__ import annotations

from bigbatch.rewards.builtin import BUILTINS, END, RewardFunction
from bigbatch.rewards.functions import RewardError, RewardSet, RewardSpec, parse_rewards

__all__ = ["BUILTINS", "END", "RewardError", "RewardFunction", "RewardSet", "RewardSpec", "parse_rewards"]
