"""Task suites, by name (``rollout.task``): the built-in ``calculator``, ``arith``, ``even_tokens`` and
``dataset`` (prompts from files, ``rollout.data``), ``code_repair`` (buggy repositories with hidden tests,
``rollout.code_repair``; ``tasks/code_repair/``), ``gym`` (a Gymnasium / GEM / SkyRL-Gym text environment,
``rollout.gym``; ``tasks/gym_env.py``), ``harbor`` (Harbor task folders in the sandbox, ``rollout.harbor``;
``tasks/harbor/``), ``verifiers`` (a verifiers environment, ``rollout.verifiers``; ``tasks/verifiers_env.py``), or a user's own as ``package.module:attr`` /
``path/to/file.py:attr``.

A registry entry is a factory ``(rollout: RolloutConfig) -> TaskSuite`` (a suite class whose
constructor takes the rollout section works too); the ``TaskSuite`` protocol (``tasks/base.py``) is
three methods: ``tasks(split, n, seed)``, ``agent(sampling)`` and ``score(task, outcome, calls)``.
``make_suite`` returns the suite wrapped with the rollout section (``ConfiguredSuite``), so agent
factories can read their knobs from ``suite.rollout``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arborl.registry import Registry
from arborl.tasks.arith import ArithSuite
from arborl.tasks.base import ConfiguredSuite, SuiteFactory, TaskSuite
from arborl.tasks.calculator import CalculatorSuite
from arborl.tasks.process_rewards import ProcessRewardRules
from arborl.tasks.chain import ChainSuite
from arborl.tasks.data_files import DatasetError
from arborl.tasks.dataset import DatasetSuite
from arborl.tasks.reward_fn import REWARD_FUNCTIONS, RewardFunction, RewardFunctionError
from arborl.tasks.toy import EvenTokensSuite

if TYPE_CHECKING:
    from arborl.config import RolloutConfig
    from arborl.tasks.code_repair import CodeRepairSuite
    from arborl.tasks.gym_env import GymSuite
    from arborl.tasks.harbor import HarborSuite
    from arborl.tasks.verifiers_env import VerifiersSuite

TASK_SUITES: Registry[SuiteFactory] = Registry("task suite")


@TASK_SUITES.register("calculator")
def _calculator(rollout: "RolloutConfig") -> CalculatorSuite:
    rules = ProcessRewardRules() if rollout.process_penalties else ProcessRewardRules(0.0, 0.0, 0.0)
    return CalculatorSuite(in_context_example=rollout.in_context_example, max_turns=rollout.max_turns,
                           process_rules=rules)


@TASK_SUITES.register("arith")
def _arith(rollout: "RolloutConfig") -> ArithSuite:
    return ArithSuite()


@TASK_SUITES.register("even_tokens")
def _even_tokens(rollout: "RolloutConfig") -> EvenTokensSuite:
    return EvenTokensSuite()


@TASK_SUITES.register("chain")
def _chain(rollout: "RolloutConfig") -> ChainSuite:
    return ChainSuite(steps=max(1, rollout.max_turns - 1), in_context_example=rollout.in_context_example)


@TASK_SUITES.register("chain_tokens")
def _chain_tokens(rollout: "RolloutConfig") -> ChainSuite:
    return ChainSuite(steps=rollout.max_turns, tokens=True)


@TASK_SUITES.register("dataset")
def _dataset(rollout: "RolloutConfig") -> DatasetSuite:
    return DatasetSuite(rollout.data, max_turns=rollout.max_turns, eval_tasks=rollout.eval_tasks)


@TASK_SUITES.register("code_repair")
def _code_repair(rollout: "RolloutConfig") -> "CodeRepairSuite":
    from arborl.tasks.code_repair import CodeRepairSuite  # materialises its tasks: only when asked for

    return CodeRepairSuite(rollout.code_repair, envs=rollout.envs, max_turns=rollout.max_turns,
                           command_timeout_s=rollout.envs.wall_s)


@TASK_SUITES.register("gym")
def _gym(rollout: "RolloutConfig") -> "GymSuite":
    from arborl.tasks.gym_env import GymSuite

    return GymSuite(rollout)


@TASK_SUITES.register("harbor")
def _harbor(rollout: "RolloutConfig") -> "HarborSuite":
    from arborl.tasks.harbor import HarborSuite

    return HarborSuite(rollout.harbor, envs=rollout.envs, max_turns=rollout.max_turns,
                       command_timeout_s=rollout.envs.wall_s)


@TASK_SUITES.register("verifiers")
def _verifiers(rollout: "RolloutConfig") -> "VerifiersSuite":
    from arborl.tasks.verifiers_env import VerifiersSuite

    return VerifiersSuite(rollout)


def make_suite(rollout: "RolloutConfig") -> ConfiguredSuite:
    """The task suite ``rollout.task`` names, built from the rollout section (and carrying it)."""
    return ConfiguredSuite(TASK_SUITES.get(rollout.task)(rollout), rollout)


__all__ = [
    "REWARD_FUNCTIONS",
    "TASK_SUITES",
    "ConfiguredSuite",
    "DatasetError",
    "DatasetSuite",
    "RewardFunction",
    "RewardFunctionError",
    "SuiteFactory",
    "TaskSuite",
    "make_suite",
]
