"""The learner's intake: batches of admissible groups from the replay stream
(`batches`), the one copy of the group-validity rules (`group_check`), and PPO ticket
reclaim (`ticket_reclaim`)."""
