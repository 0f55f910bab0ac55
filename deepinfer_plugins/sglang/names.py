"""Names both register.py and spec_decode.py need: here, so that neither imports the other."""

SPEC_ALGORITHM = "DEEPINFER_DSPARK"
V41_ARCH = "DeepseekV41ForCausalLM"
