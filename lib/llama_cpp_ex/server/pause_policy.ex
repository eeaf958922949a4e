defmodule LlamaCppEx.Server.PausePolicy do
  @moduledoc """
  Decides, every tick, whether a `LlamaCppEx.Server` may run its forward pass: a thermal or
  battery signal, a load shedder, a maintenance window.

  Configure it with `pause_policy: MyPolicy` or `pause_policy: {MyPolicy, arg}`; the server
  calls `c:pause_level/2` before each pass (and, while paused, every `:pause_poll_ms`) with
  what it is doing and `arg` (`[]` by default). Levels:

    * `:none` - run.
    * `:prefill` - decode the requests already generating, but evaluate no prompt chunk and no
      embedding text (new requests wait in their slots or the queue).
    * `:full` - no forward pass at all.

  Queued and active requests are kept in both paused levels; caller timeouts still apply (a
  stream that gets no token within its `:timeout` ends with `{:error, :timeout}` and frees its
  slot). The effective level is the stronger of the policy's and `LlamaCppEx.Server.pause/2`'s.
  Time in `:full` is left out of `get_stats/1`'s `tokens_per_second` window.

      defmodule MyApp.Thermal do
        @behaviour LlamaCppEx.Server.PausePolicy

        @impl true
        def pause_level(_info, _arg) do
          case File.read("/sys/class/thermal/thermal_zone0/temp") do
            {:ok, milli} -> if String.to_integer(String.trim(milli)) > 90_000, do: :full, else: :none
            _ -> :none
          end
        end
      end

  A policy that raises or returns anything else counts as `:none` (logged once per server):
  a broken sensor never stops a server.
  """

  @type level :: :none | :prefill | :full

  @typedoc """
  `active_slots`, `queue_depth`, `embed_queue_depth`, `tick` and `manual` (the level set by
  `LlamaCppEx.Server.pause/2`).
  """
  @type info :: %{
          active_slots: non_neg_integer(),
          queue_depth: non_neg_integer(),
          embed_queue_depth: non_neg_integer(),
          tick: non_neg_integer(),
          manual: level()
        }

  @callback pause_level(info(), arg :: term()) :: level()

  @levels [:none, :prefill, :full]

  @doc false
  def levels, do: @levels

  @doc false
  # The stronger of two levels.
  def max(a, b), do: if(rank(a) >= rank(b), do: a, else: b)

  defp rank(:none), do: 0
  defp rank(:prefill), do: 1
  defp rank(:full), do: 2
end
