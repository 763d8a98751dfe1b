"""Training: state creation (born sharded), the step, the loop `fit` and metrics (checkpoints: `jaxpar.store`)."""

from jaxpar.train.loop import FitResult, Trainer, build_trainer, fit
from jaxpar.train.state import TrainState, create_state, lr_schedule, make_optimizer
from jaxpar.train.step import make_eval_step, make_train_step, next_token_loss

__all__ = ["FitResult", "TrainState", "Trainer", "build_trainer", "create_state", "fit", "lr_schedule", "make_eval_step", "make_optimizer",
           "make_train_step", "next_token_loss"]
