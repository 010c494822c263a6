"""`SpecStats`: the counters of one `generate` call (rounds, tokens, acceptance, timings)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters of one `generate` call. `tau`: tokens committed per verify forward (bonus included);
    `alpha`: accepted / proposed drafts; `per_position[i]`: acceptance at draft position i (a tree's depth i + 1)
    given that drafts < i were accepted and a draft stood at position i. `timings` (seconds): prefill, draft,
    verify (with accept and commit; with static shapes it also holds the drafting of a drafter that drafts inside
    the device step), total."""

    rounds: int = 0  # verify forwards, counted per request
    steps: int = 0  # verify forwards of the batch: a round of B rows counts once (rounds / steps: rows per round)
    tokens: int = 0  # tokens committed by verify forwards (accepted drafts + bonus)
    proposed: int = 0
    accepted: int = 0
    drafter_failures: int = 0
    prompt_tokens: int = 0  # tokens of the prompts admitted
    cached_tokens: int = 0  # of those, served from the prefix cache (not prefilled)
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    collectives: list[int] = field(default_factory=list)  # tensor parallel: the collectives of each batch round
    timings: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0,
                                                               "total": 0.0})

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """The share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    def record(self, num_drafts: list[int], num_accepted: list[int], num_reached: list[int]) -> None:
        """One round: drafts proposed, accepted and positions reached per row (host lists). Position i was
        reached when drafts < i were all accepted and a draft stood at position i after them (a chain's next
        draft, a child of the last accepted tree node), so every listed position was reached at least once."""
        self.steps += 1
        for g, n, m in zip(num_drafts, num_accepted, num_reached):
            self.rounds += 1
            self.tokens += n + 1
            self.proposed += g
            self.accepted += n
            while len(self.reached) < m:
                self.reached.append(0)
                self.accepted_at.append(0)
            for i in range(m):
                self.reached[i] += 1
                self.accepted_at[i] += int(i < n)

    def as_dict(self) -> dict:
        return dict(rounds=self.rounds, steps=self.steps, tokens=self.tokens, tau=self.tau, alpha=self.alpha,
                    proposed=self.proposed, accepted=self.accepted, per_position=self.per_position,
                    drafter_failures=self.drafter_failures, prompt_tokens=self.prompt_tokens,
                    cached_tokens=self.cached_tokens, prefix_hit_rate=self.prefix_hit_rate,
                    timings=dict(self.timings))
