"""Data files shipped with digen: the built-in prompt sets (:data:`digen.prompts.BUILTIN_SETS`)."""
