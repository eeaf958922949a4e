defmodule LlamaCppEx.Server.Request do
  @moduledoc false
  # Everything one request carries from admission to its end: who waits for it, how to
  # sample, what turns its tokens into text, and its timing. The KV state it uses lives in its
  # slot (`LlamaCppEx.Server.Slot`).

  alias LlamaCppEx.Pipeline

  @enforce_keys [:tokens, :max_tokens, :opts]
  defstruct [
    :tokens,
    :max_tokens,
    :opts,
    :stream_pid,
    :stream_ref,
    :monitor_ref,
    :sampler,
    :pipeline,
    cache_prompt: true,
    session: nil,
    cache_scope: nil,
    t_start: nil,
    t_first_token: nil,
    n_prefix_cache: 0,
    # speculation: the draft length (nil: off), whether drafts come from the Server's draft
    # model (else prompt lookup), drafts proposed and accepted
    n_draft: nil,
    draft_model?: false,
    n_drafted: 0,
    n_accepted: 0
  ]

  @type t :: %__MODULE__{
          tokens: [non_neg_integer()],
          max_tokens: pos_integer(),
          opts: keyword(),
          stream_pid: pid() | nil,
          stream_ref: reference() | nil,
          monitor_ref: reference() | nil,
          sampler: LlamaCppEx.Sampler.t() | nil,
          pipeline: Pipeline.t() | nil
        }

  @doc "A request whose events go to `pid` tagged with `ref`."
  @spec stream([non_neg_integer()], pos_integer(), keyword(), pid(), reference()) :: t()
  def stream(tokens, max, opts, pid, ref) do
    struct!(__MODULE__,
      tokens: tokens,
      max_tokens: max,
      opts: opts,
      stream_pid: pid,
      stream_ref: ref,
      cache_prompt: Keyword.get(opts, :cache_prompt, true),
      session: Keyword.get(opts, :session),
      cache_scope: Keyword.get(opts, :cache_scope),
      sampler: Keyword.get(opts, :sampler),
      n_draft: Keyword.get(opts, :n_draft),
      draft_model?: Keyword.get(opts, :draft_model?) == true,
      pipeline: Pipeline.new(Keyword.put(opts, :max_tokens, max))
    )
  end

  @doc "Every request is streamed to its consumer (blocking calls collect in the caller)."
  @spec type(t()) :: :stream
  def type(%__MODULE__{}), do: :stream

  @spec consumer_pid(t()) :: pid() | nil
  def consumer_pid(%__MODULE__{stream_pid: pid}), do: pid

  @doc "The session-affinity key (`{cache_scope, session}`), or `nil`."
  @spec session_key(t()) :: term()
  def session_key(%__MODULE__{session: nil}), do: nil
  def session_key(%__MODULE__{session: s, cache_scope: scope}), do: {scope, s}

  @doc "Sends events to the consumer."
  @spec deliver(t(), [Pipeline.event()]) :: :ok
  def deliver(%__MODULE__{stream_pid: pid, stream_ref: ref}, events) do
    Enum.each(events, fn event -> send(pid, {ref, event}) end)
  end
end
