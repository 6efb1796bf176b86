"""Configuration sections that more than one part reads: the section base (section.py), what `dstc eval` measures
(evaluation.py: a recipe's `eval:` section and the command's options) and speculative decoding (speculation.py:
the runtime's, `dstc generate`'s and eval's). They stand below the recipe, the runtime and eval, which all hold them."""
