# Shared by the Server benches: a minimal :telemetry stand-in (Hex is not reachable, so the
# real package is not a dependency) that forwards events to the process registered under
# :bench_telemetry, and a reader for the Server's tick events.
defmodule Bench.Tele do
  def install do
    unless Code.ensure_loaded?(:telemetry) do
      Code.compile_string("""
      defmodule :telemetry do
        def execute(event, m, meta) do
          case :persistent_term.get(:bench_telemetry, nil) do
            nil -> :ok
            pid -> send(pid, {:telemetry, event, m, meta})
          end
          :ok
        end
      end
      """)
    end
  end

  @doc "`{batch_size, eval_ms}` of the tick events received so far (others are dropped)."
  def collect_ticks(acc \\ []) do
    receive do
      {:telemetry, [:llama_cpp_ex, :server, :tick], m, _} ->
        collect_ticks([{m.batch_size, m.eval_ms} | acc])

      {:telemetry, _, _, _} ->
        collect_ticks(acc)
    after
      0 -> acc
    end
  end
end
