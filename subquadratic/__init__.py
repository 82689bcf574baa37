"""subquadratic: long-context attention families (SPLA, SSE, HLA) for Hugging Face Transformers.

Importing the package registers every model type with AutoConfig / AutoModel / AutoModelForCausalLM.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration import HLAConfig, SPLAConfig, SSEConfig, SubquadraticConfig
from .modeling import HLAForCausalLM, HLAModel, SPLAForCausalLM, SPLAModel, SSEForCausalLM, SSEModel, SubquadraticCache

__version__ = "0.1.0"

_FAMILIES = [(SPLAConfig, SPLAModel, SPLAForCausalLM), (HLAConfig, HLAModel, HLAForCausalLM),
             (SSEConfig, SSEModel, SSEForCausalLM)]

for _config, _model, _lm in _FAMILIES:
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)

__all__ = ["SubquadraticConfig", "SubquadraticCache", "SPLAConfig", "SPLAModel", "SPLAForCausalLM",
           "HLAConfig", "HLAModel", "HLAForCausalLM", "SSEConfig", "SSEModel", "SSEForCausalLM", "__version__"]
