"""Ray Serve LLM as the engine that runs and routes P and D replicas, with our connector between
them (``app``: the application and `neuron-disagg ray-serve`; ``backend``: how Ray shapes each leg;
``decode_server``: D's orchestration). Needs ``ray[serve]`` 2.60 beside vLLM; nothing else in the
package imports it."""
