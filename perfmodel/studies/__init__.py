"""Studies built on the model: each answers one published question with the public API
(`jalapeno`: OpenAI's Jalapeno against GB200 and GB300, as reported; `claims`: what was
reported and the checks that judge it; `inferred`: the Jalapeno parameters the reported
figures imply, and how well, fitted to the figures of `targets`; `baseline`: the GPU
baseline as InferenceMAX's recipe runs it)."""
