"""Files written safely: atomic replacement, the user's permissions, advisory locks, and where commands may write."""
