"""Models: loading a policy, reference, reward or value model from a hub name or a directory (`loading`), their
forward passes (`forward`: log-probs, values, scores), model cards (`card`) and the exported policy (`export`)."""
