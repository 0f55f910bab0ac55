"""Verification rule: deterministic cases (accept/reject bookkeeping, bonus, EOS truncation,
zero-length rows, residual fallback, KV rows to keep, greedy = argmax decoding) and
distribution tests: with exact toy target/draft distributions, ≥1e5 sequences drafted,
scheduled (Algorithm A, Algorithm B) and verified, the committed tokens at positions 1..3 follow
the processed target (chi-square p > 0.01), with ties at its top-k and top-p boundaries; the
look-ahead scheduler of Appendix A does not."""

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from deepinfer_plugins.dspark import length_policy as lp
from deepinfer_plugins.dspark import plan_verify_lengths
from deepinfer_plugins.dspark.verify import sample_inverse_cdf, verify
from deepinfer_plugins.models.deepseek_v41.sampling import processed_probs


def chisquare(observed, expected):
    """Pearson chi-square p-value; expected is rescaled to the observed total."""
    o = np.asarray(observed, dtype=float)
    e = np.asarray(expected, dtype=float)
    e = e * o.sum() / e.sum()
    return chi2.sf(((o - e) ** 2 / e).sum(), o.size - 1)


def onehot(idx, vocab):
    return torch.nn.functional.one_hot(torch.tensor(idx), vocab).double()


def test_bookkeeping_reject_bonus_and_kv_keep():
    V = 4
    p = torch.full((2, 4, V), 0.25, dtype=torch.float64)
    q = torch.full((2, 3, V), 0.25, dtype=torch.float64)
    p[0, 1] = torch.tensor([0.0, 0.0, 1.0, 0.0])  # row 0: x_2 = 1 has p = 0 -> rejected
    x = torch.tensor([[3, 1, 2], [0, 1, 2]])
    res = verify(x, torch.tensor([3, 2]), p, q, accept_u=torch.full((2, 3), 0.5, dtype=torch.float64),
                 sample_u=torch.tensor([0.0, 0.9], dtype=torch.float64))
    assert res.num_accepted.tolist() == [1, 2]
    assert res.committed.tolist() == [[3, 2, -1, -1], [0, 1, 3, -1]]  # correction = 2 (residual), bonus from p_3
    assert res.num_committed.tolist() == [2, 3]
    assert res.is_bonus.tolist() == [False, True]
    assert res.kv_keep.tolist() == [2, 3]
    assert not res.eos_truncated.any()


def test_zero_length_rows_decode_one_token_from_p1():
    V = 5
    p = torch.softmax(torch.randn(3, 3, V, dtype=torch.float64), -1)
    u = torch.tensor([0.1, 0.5, 0.95], dtype=torch.float64)
    res = verify(torch.full((3, 2), -1), torch.zeros(3, dtype=torch.long), p, None, sample_u=u)
    assert res.num_accepted.tolist() == [0, 0, 0]
    assert res.committed[:, 0].tolist() == sample_inverse_cdf(p[:, 0], u).tolist()
    assert (res.committed[:, 1:] == -1).all() and res.is_bonus.all() and res.kv_keep.tolist() == [1, 1, 1]
    empty = verify(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, 3, V))
    assert empty.committed.shape == (0, 3)
    k0 = verify(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), p[:2, :1])
    assert k0.num_committed.tolist() == [1, 1]


def test_eos_inside_accepted_prefix_truncates_commit():
    V, EOS = 4, 3
    p = torch.full((1, 4, V), 0.25, dtype=torch.float64)
    x = torch.tensor([[1, EOS, 2]])
    res = verify(x, torch.tensor([3]), p, None, eos_token_id=EOS, accept_u=torch.zeros(1, 3, dtype=torch.float64))
    assert res.eos_truncated.tolist() == [True]
    assert res.num_accepted.tolist() == [2] and res.num_committed.tolist() == [2]
    assert res.committed.tolist() == [[1, EOS, -1, -1]] and res.kv_keep.tolist() == [3]
    assert not res.is_bonus.any()
    # EOS drafted but rejected before it is reached: no truncation
    p[0, 0] = onehot(0, V)
    res = verify(x, torch.tensor([3]), p, None, eos_token_id=EOS, accept_u=torch.zeros(1, 3, dtype=torch.float64))
    assert not res.eos_truncated.any() and res.committed.tolist() == [[0, -1, -1, -1]]


def test_residual_with_no_mass_falls_back_to_p():
    V = 3
    q = torch.tensor([[[0.5, 0.3, 0.2]]], dtype=torch.float64)
    p_row = q[0, 0].clone()
    p_row[0] -= 1e-9  # rejection of x = 0 possible only by float noise; residual mass 1e-9
    p_row[1] += 1e-9
    p = torch.stack([p_row, p_row])[None]  # [1, 2, V]
    res = verify(torch.tensor([[0]]), torch.tensor([1]), p, q,
                 accept_u=torch.tensor([[1 - 1e-12]], dtype=torch.float64), sample_u=torch.tensor([0.1], dtype=torch.float64))
    assert res.num_accepted.tolist() == [0]
    assert res.committed[0, 0].item() == 0  # sampled from p (u = 0.1 -> token 0), not from the residual (token 1)


def test_greedy_target_is_exact_argmax_decoding():
    torch.manual_seed(0)
    V, rows, k = 7, 64, 4
    logits = torch.randn(rows, k + 1, V)
    p = processed_probs(logits, temperature=0.0)
    argmax = logits.argmax(-1)
    x = torch.where(torch.rand(rows, k) < 0.7, argmax[:, :k], torch.randint(0, V, (rows, k)))
    n = torch.randint(0, k + 1, (rows,))
    res = verify(x, n, p, torch.softmax(torch.randn(rows, k, V), -1))
    for r in range(rows):
        m = 0
        while m < n[r] and x[r, m] == argmax[r, m]:
            m += 1
        expect = x[r, :m].tolist() + [argmax[r, m].item()]
        assert res.committed[r, : m + 1].tolist() == expect and res.num_accepted[r] == m


def test_bad_inputs():
    p = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="target_probs"):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), p[:, :2])
    with pytest.raises(ValueError, match="num_verify"):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]), p)
    with pytest.raises(ValueError, match="token"):
        verify(torch.tensor([[9, 0]]), torch.tensor([1]), p)
    with pytest.raises(TypeError):
        verify(torch.zeros(1, 2), torch.tensor([1]), p)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([1]), p, torch.full((1, 2, 5), 0.2))


# --------------------------------------------------------------------------- distribution tests

V, GAMMA, N_SEQ, GROUP = 5, 3, 100_000, 8


# Target rows with ties on the boundaries, as probabilities after T = 0.9 (logits = 0.9 log p):
# after 0, ids 0, 2 and 4 tie at the 4th value, so top-k 4 keeps 0 and 2 and drops 4;
# after 1, top-k drops id 4, then ids 0 and 3 tie where the mass crosses top-p 0.95
# (0.921 before the first, 0.956 before the second), so top-p keeps 1 and 0 and drops 3 (and 2).
TIED_ROWS = {0: ([0.1, 0.4, 0.1, 0.3, 0.1], [0, 1, 2, 3]),
             1: ([0.035, 0.92, 0.01, 0.035, 0.001], [0, 1])}


def toy_models(seed):
    """Exact bigram target (processed: T = 0.9, top-k 4, top-p 0.95; the rows after 0 and 1 tie on
    the boundaries) and a worse, position-dependent bigram drafter q_k(· | x_{k-1})."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5
    for row, (probs, _) in TIED_ROWS.items():
        target_logits[row] = 0.9 * torch.tensor(probs, dtype=torch.float64).log()
    p = processed_probs(target_logits, temperature=0.9, top_k=4, top_p=0.95)  # [prev, V]
    for row, (_, support) in TIED_ROWS.items():
        assert p[row].nonzero().flatten().tolist() == support, (row, p[row])
    q = torch.stack([torch.softmax(target_logits * 0.9 + torch.randn(V, V, generator=g, dtype=torch.float64)
                                   * (0.3 + 0.4 * k), -1) for k in range(GAMMA)])  # [k, prev, V]
    return p, q


def chi_square_joint(tokens, p, anchor=0):
    """p-value of the (t1, t2, t3) joint against the bigram chain; zero cells must stay empty."""
    # expected[a, b, c] = p(a | anchor) p(b | a) p(c | b)
    expected = p[anchor][:, None, None].numpy() * p.numpy()[:, :, None] * p.numpy()[None, :, :]
    idx = (tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2]).numpy()
    observed = np.bincount(idx, minlength=V**3).astype(float)
    e = expected.reshape(-1) * len(idx)
    assert observed[e == 0].sum() == 0, "a token the processed target forbids was committed"
    big = e >= 5
    obs = np.r_[observed[big], observed[~big & (e > 0)].sum()]
    exp = np.r_[e[big], e[~big & (e > 0)].sum()]
    keep = exp > 0
    return chisquare(obs[keep], exp[keep])


def run_sequences(p, q, scheduler, greedy_draft, seed):
    """Draft, schedule (groups of GROUP requests per engine step), verify, until 3 tokens each."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((N_SEQ, 3), -1, dtype=torch.long)
    n_out = torch.zeros(N_SEQ, dtype=torch.long)
    anchor = torch.zeros(N_SEQ, dtype=torch.long)
    tv = 1 - 0.5 * (p[None] - q).abs().sum(-1)  # [k, prev] = exact conditional acceptance c*_k
    hist = np.zeros(GAMMA + 1, dtype=np.int64)
    while (n_out < 3).any():
        prev, xs, qs, cs = anchor, [], [], []
        for k in range(GAMMA):
            qk = q[k][prev]  # [N, V]
            if greedy_draft:
                xk = qk.argmax(-1)
                cs.append(p[prev, xk])  # accept prob of a one-hot draft; a function of x_{k-1}
            else:
                xk = torch.multinomial(qk, 1, generator=g).squeeze(-1)
                cs.append(tv[k][prev])
            xs.append(xk), qs.append(qk)
            prev = xk
        x = torch.stack(xs, 1)
        target = p[torch.cat([anchor[:, None], x], 1)]  # [N, γ+1, V]
        conf = torch.stack(cs, 1).numpy().reshape(-1, GROUP, GAMMA)
        lengths = torch.from_numpy(np.concatenate([scheduler(gi, c) for gi, c in enumerate(conf)]))
        hist += np.bincount(lengths.numpy(), minlength=GAMMA + 1)
        res = verify(x, lengths, target, None if greedy_draft else torch.stack(qs, 1), generator=g)
        for j in range(GAMMA + 1):
            take = (j < res.num_committed) & (n_out < 3)
            out[take, n_out[take]] = res.committed[take, j]
            n_out += take.long()
        anchor = res.committed.gather(1, (res.num_committed - 1)[:, None]).squeeze(1)
    return out, hist


def knee_cost(B):
    return 1.0 + 0.03 * max(0, B - 2 * GROUP)


def schedule_a(_, conf):
    return np.array(plan_verify_lengths(conf.tolist(), knee_cost), dtype=np.int64)


def make_schedule_b():
    states = {}

    def schedule(gi, conf):
        state = states.setdefault(gi, lp.StaleBudget("global", lag=1))
        n = np.full(conf.shape[0], GAMMA)
        return state.plan(lp.cumulative_survival(conf, n), n, knee_cost)
    return schedule


@pytest.mark.parametrize("greedy_draft", [False, True], ids=["sampled-draft", "greedy-draft"])
@pytest.mark.parametrize("which", ["A", "B"])
def test_committed_tokens_follow_processed_target(which, greedy_draft):
    p, q = toy_models(seed=1)
    scheduler = schedule_a if which == "A" else make_schedule_b()
    tokens, hist = run_sequences(p, q, scheduler, greedy_draft, seed=2 + greedy_draft)
    assert (hist / hist.sum() > 0.01).sum() >= 2, hist  # the schedule really varies the lengths
    assert chi_square_joint(tokens, p) > 0.01
    for pos in range(3):  # marginals at positions 1..3
        marginal = p[0] if pos == 0 else (torch.linalg.matrix_power(p, pos + 1)[0])
        obs = np.bincount(tokens[:, pos].numpy(), minlength=V)
        e = marginal.numpy() * N_SEQ
        assert obs[e == 0].sum() == 0
        assert chisquare(obs[e > 0], e[e > 0]) > 0.01


def test_distribution_test_detects_a_biased_verifier():
    # negative control: accepting every draft commits q's chain, and the test must notice.
    p, q = toy_models(seed=1)
    g = torch.Generator().manual_seed(5)
    prev, toks = torch.zeros(N_SEQ, dtype=torch.long), []
    for k in range(3):
        prev = torch.multinomial(q[k][prev], 1, generator=g).squeeze(-1)
        toks.append(prev)
    tokens = torch.stack(toks, 1)
    with pytest.raises(AssertionError):
        assert chi_square_joint(tokens, p) > 0.01


# --------------------------------------------------------------------------- Appendix A

P_A = torch.tensor([0.7, 0.3], dtype=torch.float64)
Q_A = torch.tensor([0.5, 0.5], dtype=torch.float64)
COST_A = {1: 1.0, 2: 1 / 0.5, 3: 1 / 0.45}.__getitem__


def appendix_a_first_tokens(scheduler, n=100_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(Q_A.expand(n, 2), 2, replacement=True, generator=g)  # [n, 2] drafts
    c1 = np.full(n, 1 - 0.5 * (P_A - Q_A).abs().sum().item())  # 0.8
    c2 = np.where(x[:, 0].numpy() == 0, 0.9, 0.1)  # c_2 sees x_1 through the Markov embedding
    lengths = torch.from_numpy(scheduler(np.stack([c1, c2], 1)))
    res = verify(x, lengths, P_A.expand(n, 3, 2).clone(), Q_A.expand(n, 2, 2).clone(), generator=g)
    return res.committed[:, 0], lengths


def lookahead(conf):  # retrospective global argmax over the current block (unsafe)
    a = np.cumprod(conf, axis=1)
    return np.array([lp.search_budget(row, 1, COST_A) for row in a], dtype=np.int64)


def algorithm_a_each(conf):
    return np.array([plan_verify_lengths([row], COST_A)[0] for row in conf.tolist()], dtype=np.int64)


def algorithm_b_each(conf):
    state = lp.StaleBudget("global", lag=2)
    n = np.full(1, 2)
    return np.array([state.plan(np.cumprod(row)[None], n, COST_A)[0] for row in conf], dtype=np.int64)


@pytest.mark.parametrize("name,scheduler,lossless", [
    ("lookahead", lookahead, False), ("A", algorithm_a_each, True), ("B", algorithm_b_each, True)])
def test_appendix_a_counterexample(name, scheduler, lossless):
    first, lengths = appendix_a_first_tokens(scheduler)
    n = first.numel()
    count_a = int((first == 0).sum())
    pvalue = chisquare([count_a, n - count_a], [0.7 * n, 0.3 * n])
    if lossless:
        assert pvalue > 0.01, (name, count_a / n)
    else:
        assert pvalue < 1e-6 and abs(count_a / n - 0.85) < 0.01  # the paper's 0.85 instead of 0.7
    if name == "B":
        assert set(lengths.tolist()) == {0, 2}  # the budget really varies, from stale blocks only
