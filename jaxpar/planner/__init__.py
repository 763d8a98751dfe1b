"""The analytic model of a train step and the search over layouts it ranks.

- `expected`: FLOPs and collective bytes per device per step (what `jaxpar analyze` sets beside the compiled program);
- `memory`: the step's memory per device by part, predicted without devices or a compile.
"""
