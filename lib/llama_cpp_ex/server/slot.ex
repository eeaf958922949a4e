defmodule LlamaCppEx.Server.Slot do
  @moduledoc false
  # One KV sequence of the server's context and the request using it. Its bookkeeping mirrors
  # the sequence exactly: an idle slot's `cached` tokens, a prefilling slot's prompt up to
  # `prefill_pos`, a generating slot's prompt plus the generated tokens already fed (`fed`,
  # newest first). `pending` is the token sampled last tick, fed in the next one; a `chained`
  # slot's next token is fed by a step already queued (the engine takes it from the step
  # before), so it goes straight to `fed` when it comes; until then the queued steps leave
  # one token more in the cache than `fed` lists.

  alias LlamaCppEx.Server.Request

  defstruct [
    :seq,
    state: :idle,
    request: nil,
    cached: [],
    prompt: {},
    n_prompt: 0,
    prefill_pos: 0,
    pos: 0,
    pending: nil,
    chained: false,
    fed: [],
    cache_scope: nil,
    session: nil,
    t_last_used: 0
  ]

  @type state :: :idle | :prefilling | :generating
  @type t :: %__MODULE__{
          seq: non_neg_integer(),
          state: state(),
          request: Request.t() | nil,
          cached: [non_neg_integer()],
          prompt: tuple(),
          n_prompt: non_neg_integer(),
          prefill_pos: non_neg_integer(),
          pos: non_neg_integer(),
          pending: non_neg_integer() | nil,
          chained: boolean(),
          fed: [non_neg_integer()],
          cache_scope: term(),
          session: term(),
          t_last_used: integer()
        }

  @spec idle(non_neg_integer()) :: t()
  def idle(seq), do: %__MODULE__{seq: seq}

  @spec active?(t()) :: boolean()
  def active?(%__MODULE__{state: s}), do: s != :idle

  @doc "Tokens the slot's KV sequence holds."
  @spec fed_tokens(t()) :: [non_neg_integer()]
  def fed_tokens(%__MODULE__{state: :idle, cached: cached}), do: cached

  def fed_tokens(%__MODULE__{state: :prefilling} = s),
    do: s.prompt |> Tuple.to_list() |> Enum.take(s.prefill_pos)

  def fed_tokens(%__MODULE__{state: :generating} = s),
    do: Tuple.to_list(s.prompt) ++ Enum.reverse(s.fed)

  @doc "Number of tokens the slot's KV sequence holds."
  @spec fed_length(t()) :: non_neg_integer()
  def fed_length(%__MODULE__{state: :idle, cached: cached}), do: length(cached)
  def fed_length(%__MODULE__{state: :prefilling, prefill_pos: p}), do: p
  def fed_length(%__MODULE__{state: :generating} = s), do: s.n_prompt + length(s.fed)

  @doc """
  The slot after its request ended, keeping what it fed as cache (nothing with
  `cache_prompt: false`).
  """
  @spec release(t(), integer()) :: t()
  def release(%__MODULE__{} = s, now) do
    cached = if s.request && s.request.cache_prompt, do: fed_tokens(s), else: []

    %__MODULE__{
      seq: s.seq,
      cached: cached,
      cache_scope: s.cache_scope,
      session: s.session,
      t_last_used: now
    }
  end
end
