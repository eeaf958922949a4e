defmodule LlamaCppEx.Telemetry do
  @moduledoc false
  # Emits through `:telemetry` when the application has it; this library does not depend on
  # it (Hex packages are optional for users, and the events are documented in
  # LlamaCppEx.Server).
  #
  # Whether it is there is asked of the code server once: `Code.ensure_loaded?/1` on a module
  # that does not exist searches every directory of the code path (~1 ms with 40 of them),
  # and the Server emits an event per tick. A module loaded later (`:telemetry` started after
  # this library) is still seen: a loaded module answers `:erlang.module_loaded/1` without
  # asking anyone.

  @probed {__MODULE__, :probed}

  @spec execute([atom()], map(), map()) :: :ok
  def execute(event, measurements, metadata) do
    if available?() do
      # credo:disable-for-next-line
      apply(:telemetry, :execute, [event, measurements, metadata])
    end

    :ok
  end

  defp available? do
    :erlang.module_loaded(:telemetry) or
      (not :persistent_term.get(@probed, false) and probe())
  end

  defp probe do
    loaded = Code.ensure_loaded?(:telemetry)
    :persistent_term.put(@probed, true)
    loaded
  end
end
