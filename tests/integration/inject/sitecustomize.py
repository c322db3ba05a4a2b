"""Put on a vLLM instance's PYTHONPATH by a test: with NEURON_DISAGG_TEST_BREAK_RECEIVER naming a
file, D's push receiver thread raises on the first decode leg it hears of once that file exists, as
a bug in it would (so one instance serves other tests before it is broken). Nothing of the product
reads this; it breaks the real thread from outside, in the real process."""

import os

_flag = os.environ.get("NEURON_DISAGG_TEST_BREAK_RECEIVER")
if _flag:
    from neuron_disagg.transfer import receiver

    _working_expect = receiver.PushReceiver._expect

    def _expect(self, item, now):
        if os.path.exists(_flag):
            raise RuntimeError("a bug in the receiver, injected by the test")
        return _working_expect(self, item, now)

    receiver.PushReceiver._expect = _expect
