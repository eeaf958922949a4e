defmodule LlamaCppEx.Telemetry do
  @moduledoc false
  # Emits through `:telemetry` when the application has it; this library does not depend on
  # it (Hex packages are optional for users, and the events are documented in
  # LlamaCppEx.Server).

  @spec execute([atom()], map(), map()) :: :ok
  def execute(event, measurements, metadata) do
    if Code.ensure_loaded?(:telemetry) do
      # credo:disable-for-next-line
      apply(:telemetry, :execute, [event, measurements, metadata])
    end

    :ok
  end
end
