"""The learner's checkpoints: the folder's files and atomic swap (`files`), the resume
rules (`resume`), and the `Checkpointer` the loop holds (`checkpointer`)."""
