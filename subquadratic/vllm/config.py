"""vLLM's per-architecture config hook for the subquadratic families: what vLLM must not turn on.

vLLM runs `verify_and_update_config` before its own hybrid-model set-up. Prefix caching of a hybrid
model ("align" mode) saves and restores each state at block boundaries through the model's own copy
functions and metadata; the plugin's state layers keep one state per sequence and do not implement
that, so prefix caching is turned off here, with a line in the log saying so (vLLM turns it on by
default for every generative model). It also runs the model eagerly (`enforce_eager`): a step's
prefills run one sequence at a time with their lengths read on the host, which a captured CUDA graph
cannot replay.
"""

from __future__ import annotations

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

logger = logging.getLogger("subquadratic.vllm")

PREFIX_CACHING_OFF = ("subquadratic: prefix caching is off for {arch}: its state layers keep one state "
                      "per sequence and cannot resume from a cached prefix (docs/design.md, 'Serving with vLLM')")


class SubquadraticVLLMConfig(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        cache_config = vllm_config.cache_config
        if cache_config.enable_prefix_caching:
            cache_config.enable_prefix_caching = False
            logger.warning(PREFIX_CACHING_OFF.format(arch=vllm_config.model_config.architecture))
        if not vllm_config.model_config.enforce_eager:
            vllm_config.model_config.enforce_eager = True
            logger.info("subquadratic: running eagerly (no CUDA graphs): the state layers' prefills read lengths "
                        "on the host")
