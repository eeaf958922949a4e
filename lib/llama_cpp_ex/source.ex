defmodule LlamaCppEx.Source do
  @moduledoc false
  # One request's events (`LlamaCppEx.Pipeline.event/0`), from either route: a generation on
  # a model (`LlamaCppEx.Stepper`, stepped by the caller) or a `LlamaCppEx.Server`
  # subscription (`{ref, event}` messages). Every facade function and the Server's client
  # functions consume requests through this module, so timeouts, cancellation and the
  # server's death are handled once:
  #
  #   * `:timeout` bounds the wait for each event (a local step that took longer also counts);
  #   * closing an unfinished server request cancels it (the slot is freed within one tick);
  #   * a server that dies ends the request with `{:error, :server_down}` within a second.

  alias LlamaCppEx.{Generation, Server, Stepper}

  defstruct [:kind, :stepper, :server, :ref, :monitor, :timeout, done: false]

  @type t :: %__MODULE__{
          kind: :stepper | :server,
          stepper: Stepper.t() | nil,
          server: pid() | nil,
          ref: reference() | nil,
          monitor: reference() | nil,
          timeout: timeout(),
          done: boolean()
        }

  @doc "A prepared request on its model (`opts`: the context options)."
  @spec stepper(Generation.t(), keyword(), timeout()) :: {:ok, t()} | {:error, term()}
  def stepper(%Generation{} = gen, opts, timeout) do
    with {:ok, stepper} <- Stepper.start(gen, opts) do
      {:ok, from_stepper(stepper, timeout)}
    end
  end

  @doc "A prepared request on sequence 0 of a context of the caller's (see `Stepper.on_context/2`)."
  @spec on_context(LlamaCppEx.Context.t(), Generation.t(), timeout()) :: t()
  def on_context(ctx, %Generation{} = gen, timeout),
    do: from_stepper(Stepper.on_context(ctx, gen), timeout)

  defp from_stepper(stepper, timeout),
    do: %__MODULE__{kind: :stepper, stepper: stepper, timeout: timeout}

  @doc """
  A prepared request admitted by the server `pid` from this process (`opts`: the request's
  server options, `:mode` for telemetry).
  """
  @spec server(pid(), Generation.t(), keyword(), timeout()) :: {:ok, t()} | {:error, term()}
  def server(pid, %Generation{} = gen, opts, timeout) do
    ref = make_ref()
    mref = Process.monitor(pid)

    case Server.subscribe(pid, gen, ref, opts, timeout) do
      :ok ->
        {:ok, %__MODULE__{kind: :server, server: pid, ref: ref, monitor: mref, timeout: timeout}}

      error ->
        Process.demonitor(mref, [:flush])
        error
    end
  end

  @doc """
  The next events: `{:cont, events, src}`, or `{:done, events, src}` when the request ended
  (the last event is `{:done, reason}` or `{:error, reason}`).
  """
  @spec next(t()) :: {:cont | :done, [LlamaCppEx.Pipeline.event()], t()}
  def next(%__MODULE__{kind: :stepper, stepper: stepper, timeout: timeout} = src) do
    if timeout == 0 do
      {:done, [{:error, :timeout}], %{src | done: true}}
    else
      t0 = System.monotonic_time(:millisecond)
      {status, events, stepper} = Stepper.step(stepper)
      src = %{src | stepper: stepper, done: status == :done}

      if status == :cont and timeout != :infinity and
           System.monotonic_time(:millisecond) - t0 > timeout do
        {:done, events ++ [{:error, :timeout}], %{src | done: true}}
      else
        {status, events, src}
      end
    end
  end

  def next(%__MODULE__{kind: :server, ref: ref, monitor: mref} = src) do
    receive do
      {^ref, {tag, _} = event} when tag in [:done, :error] ->
        {:done, [event], %{src | done: true}}

      {^ref, event} ->
        {:cont, [event], src}

      {:DOWN, ^mref, :process, _, _} ->
        {:done, [{:error, :server_down}], %{src | done: true}}
    after
      src.timeout ->
        {:done, [{:error, :timeout}], src}
    end
  end

  @doc "Releases the request: an unfinished server request is cancelled."
  @spec close(t()) :: :ok
  def close(%__MODULE__{kind: :stepper}), do: :ok

  def close(%__MODULE__{kind: :server} = src) do
    unless src.done, do: Server.cancel(src.server, src.ref)
    Process.demonitor(src.monitor, [:flush])
    drain(src.ref)
  end

  defp drain(ref) do
    receive do
      {^ref, _} -> drain(ref)
    after
      0 -> :ok
    end
  end

  @doc """
  Runs the request to its end: `{:ok, %{text: t, logprobs: lps, reason: r,
  completion_tokens: n}}` or `{:error, reason}`.
  """
  @spec collect(t()) :: {:ok, map()} | {:error, term()}
  def collect(src), do: collect(src, [], [], 0)

  defp collect(src, text, lps, n) do
    {status, events, src} = next(src)

    {text, lps, n, ending} =
      Enum.reduce(events, {text, lps, n, nil}, fn
        {:token, t}, {text, lps, n, e} -> {[text, t], lps, n, e}
        {:logprob, lp}, {text, lps, n, e} -> {text, [lp | lps], n, e}
        {:usage, %{completion_tokens: c}}, {text, lps, _, e} -> {text, lps, c, e}
        {:done, reason}, {text, lps, n, _} -> {text, lps, n, {:done, reason}}
        {:error, reason}, {text, lps, n, _} -> {text, lps, n, {:error, reason}}
      end)

    case {status, ending} do
      {:done, {:done, reason}} ->
        close(src)

        {:ok,
         %{
           text: IO.iodata_to_binary(text),
           logprobs: Enum.reverse(lps),
           reason: reason,
           completion_tokens: completion_tokens(src, n)
         }}

      {:done, {:error, reason}} ->
        close(src)
        {:error, reason}

      _ ->
        collect(src, text, lps, n)
    end
  end

  defp completion_tokens(%__MODULE__{kind: :stepper, stepper: stepper}, _n),
    do: Stepper.generated(stepper)

  defp completion_tokens(_src, n), do: n
end
