defmodule LlamaCppEx.Server.Stats do
  @moduledoc false
  # A server's counters, the map `get_stats/1` answers, and the measurements of its
  # per-request telemetry events.

  alias LlamaCppEx.Server.{Request, Slot}

  defstruct tokens_generated: 0,
            prompt_tokens: 0,
            prefix_cache_tokens: 0,
            requests_completed: 0,
            embeddings_completed: 0,
            drafted_tokens: 0,
            accepted_tokens: 0,
            window_start: 0,
            window_tokens: 0,
            # time in a full pause within the window, left out of tokens_per_second
            paused_ms: 0,
            paused_since: nil

  @type t :: %__MODULE__{
          tokens_generated: non_neg_integer(),
          prompt_tokens: non_neg_integer(),
          prefix_cache_tokens: non_neg_integer(),
          requests_completed: non_neg_integer(),
          embeddings_completed: non_neg_integer(),
          drafted_tokens: non_neg_integer(),
          accepted_tokens: non_neg_integer(),
          window_start: integer(),
          window_tokens: non_neg_integer(),
          paused_ms: non_neg_integer(),
          paused_since: integer() | nil
        }

  @spec new() :: t()
  def new, do: %__MODULE__{window_start: now_ms()}

  @spec reset_window(t()) :: t()
  def reset_window(stats) do
    now = now_ms()
    since = if stats.paused_since, do: now
    %{stats | window_start: now, window_tokens: 0, paused_ms: 0, paused_since: since}
  end

  @doc "Notes the start or the end of a full pause."
  @spec paused(t(), boolean()) :: t()
  def paused(%{paused_since: nil} = stats, true), do: %{stats | paused_since: now_ms()}

  def paused(%{paused_since: since} = stats, false) when since != nil,
    do: %{stats | paused_ms: stats.paused_ms + (now_ms() - since), paused_since: nil}

  def paused(stats, _), do: stats

  @doc "Counts a finished request."
  @spec request_done(t(), Request.t()) :: t()
  def request_done(stats, request) do
    n = request.pipeline.generated

    %{
      stats
      | tokens_generated: stats.tokens_generated + n,
        prompt_tokens: stats.prompt_tokens + length(request.tokens),
        prefix_cache_tokens: stats.prefix_cache_tokens + request.n_prefix_cache,
        requests_completed: stats.requests_completed + 1,
        window_tokens: stats.window_tokens + n,
        drafted_tokens: stats.drafted_tokens + request.n_drafted,
        accepted_tokens: stats.accepted_tokens + request.n_accepted
    }
  end

  @doc "Counts the texts of a finished embedding call."
  @spec embeddings_done(t(), non_neg_integer()) :: t()
  def embeddings_done(stats, n),
    do: %{stats | embeddings_completed: stats.embeddings_completed + n}

  @doc "The map `LlamaCppEx.Server.get_stats/1` returns."
  @spec snapshot(t(), map(), non_neg_integer(), map(), non_neg_integer()) :: map()
  def snapshot(stats, slots, queue_depth, config, embed_waiting \\ 0) do
    counts = Enum.frequencies_by(slots, fn {_, s} -> s.state end)
    now = now_ms()
    window_ms = max(now - stats.window_start, 1)
    paused_ms = stats.paused_ms + if(stats.paused_since, do: now - stats.paused_since, else: 0)
    active_ms = max(window_ms - paused_ms, 1)
    # tokens of requests still running count toward the totals too
    running =
      slots
      |> Enum.filter(fn {_, s} -> s.request end)
      |> Enum.map(fn {_, s} -> s.request.pipeline.generated end)
      |> Enum.sum()

    %{
      active_slots: Map.get(counts, :prefilling, 0) + Map.get(counts, :generating, 0),
      idle_slots: Map.get(counts, :idle, 0),
      prefilling_slots: Map.get(counts, :prefilling, 0),
      queue_depth: queue_depth,
      n_parallel: config.n_parallel,
      n_batch: config.n_batch,
      n_ctx: config.n_ctx,
      tokens_generated: stats.tokens_generated + running,
      prompt_tokens: stats.prompt_tokens,
      prefix_cache_tokens: stats.prefix_cache_tokens,
      requests_completed: stats.requests_completed,
      embed_queue_depth: embed_waiting,
      embeddings_completed: stats.embeddings_completed,
      speculative_drafted: stats.drafted_tokens,
      speculative_accepted: stats.accepted_tokens,
      speculative_acceptance: ratio(stats.accepted_tokens, stats.drafted_tokens),
      window_tokens: stats.window_tokens,
      window_ms: window_ms,
      paused_ms: paused_ms,
      tokens_per_second: stats.window_tokens * 1000 / active_ms
    }
  end

  @doc "The measurements of `request.done` and `request.exception`."
  @spec done_measurements(Slot.t(), integer()) :: map()
  def done_measurements(%Slot{request: r, n_prompt: n_prompt}, now) do
    duration = max(now - (r.t_start || now), 0)
    ttft = if r.t_first_token, do: r.t_first_token - r.t_start, else: duration
    evaluated = n_prompt - r.n_prefix_cache
    gen_ms = if r.t_first_token, do: now - r.t_first_token, else: 0
    generated = r.pipeline.generated

    %{
      prompt_tokens: n_prompt,
      generated_tokens: generated,
      duration_ms: duration,
      ttft_ms: ttft,
      prompt_eval_rate: if(ttft > 0, do: evaluated * 1000 / ttft, else: 0.0),
      generation_rate: if(gen_ms > 0, do: max(generated - 1, 0) * 1000 / gen_ms, else: 0.0),
      prefix_cache_tokens: r.n_prefix_cache,
      prefix_cache_ratio: if(n_prompt > 0, do: r.n_prefix_cache / n_prompt, else: 0.0),
      drafted_tokens: r.n_drafted,
      accepted_tokens: r.n_accepted,
      acceptance_rate: ratio(r.n_accepted, r.n_drafted)
    }
  end

  defp ratio(_, 0), do: 0.0
  defp ratio(a, b), do: a / b

  @doc """
  Milliseconds since the VM started: monotonic and non-negative, so a never-used slot (0)
  always counts as least recently used.
  """
  @spec now_ms() :: integer()
  def now_ms do
    start = System.convert_time_unit(:erlang.system_info(:start_time), :native, :millisecond)
    System.monotonic_time(:millisecond) - start
  end
end
