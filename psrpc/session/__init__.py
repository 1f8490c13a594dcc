"""Runs in the chief (worker0) only, as TensorFlow's MonitoredTrainingSession: start-up (fresh or
restored), the session loop, hooks, the checkpoint saver, membership changes and the run's
outputs. The chief is also a worker: it trains through psrpc/worker/."""
